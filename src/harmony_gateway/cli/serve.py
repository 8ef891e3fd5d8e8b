"""`harmony-gateway serve`: its options (in groups, defaults shown), the Settings they make, the checks
that refuse settings which cannot work before the port is bound, and the server run in one process or
as `--workers N` processes behind uvicorn's supervisor."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
import tempfile
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ..observability.logging import configure_logging
from ..routing.kv_index import DEFAULT_MAX_BLOCKS
from ..settings import Settings, Timeouts
from ..traffic.keys import KeyPolicy, read_key_file
from ..types.limits import DEFAULT_MAX_CONVERSATION_BYTES, DEFAULT_MAX_CONVERSATION_ITEMS
from .checks import StartupError, file_problem, setting_problem
from .common import ENGINE_PROTOCOLS, pairs, positive_int, run_until_interrupted, split_list
from .config import AliasAction
from .demo import demo_banner
from .startup import bind_listener, check_resolver, check_storage, listen_url, started_lines

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

log = logging.getLogger("harmony_gateway")

#: The command line a `serve --workers N` supervisor hands its processes (`app_from_env`).
SERVE_ARGV_ENV = "HARMONY_GATEWAY_SERVE_ARGV"


#: What `serve --help` says above the options.
DESCRIPTION = (
    "Run the HTTP gateway in front of engine workers. Every option can also be set in the environment "
    "as HARMONY_GATEWAY_<OPTION> (--worker-url is HARMONY_GATEWAY_WORKER_URL; a list separated by "
    "commas; a switch true or false) or in a YAML --config file (worker-url: [grpc://a:1, grpc://b:1]); "
    "the command line wins over the environment, which wins over the file. See docs/configuration.md."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """serve's options, in the groups `serve --help` shows them in. The environment and the config file
    know every option by its first long name (cli/config.py); later names are other programs'."""
    server = p.add_argument_group("server")
    server.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML file of serve options, one key per option (policy: cache_aware); the environment and "
        "the command line take precedence (docs/configuration.md)",
    )
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument(
        "--ssl-certfile",
        "--tls-cert-path",
        default=None,
        metavar="PEM",
        help="serve HTTPS with this certificate chain (with --ssl-keyfile) (default: plain HTTP)",
    )
    server.add_argument(
        "--ssl-keyfile", "--tls-key-path", default=None, metavar="PEM", help="the certificate's private key"
    )
    server.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="gateway processes sharing the port; above 1 they share the registered workers, "
        "their health and /metrics through the storage, which must be sqlite or postgresql",
    )
    _add_engine_and_model_arguments(p.add_argument_group("engine and model"))
    _add_discovery_arguments(
        p.add_argument_group(
            "worker discovery",
            "Workers from a DNS name looked up every few seconds: a Kubernetes headless Service's pods, with no "
            "API permission. See docs/routing.md, DNS discovery.",
        )
    )
    _add_routing_arguments(p.add_argument_group("routing"))
    _add_storage_arguments(p.add_argument_group("storage"))
    _add_limits_and_traffic_arguments(
        p.add_argument_group("limits and traffic", "See README, Limits and Traffic control.")
    )
    _add_websocket_arguments(
        p.add_argument_group(
            "WebSocket mode",
            "The Responses API over one WebSocket per agent (ws://HOST:PORT/v1/responses): sequential turns, "
            "continued from the socket's own cache. See README, WebSocket mode.",
        )
    )
    _add_security_arguments(p.add_argument_group("security"))
    observability = p.add_argument_group("observability")
    observability.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity"
    )
    observability.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    observability.add_argument(
        "--log-prompts", action="store_true", help="include prompt text in request logs"
    )
    observability.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces over OTLP/HTTP to this collector (e.g. http://127.0.0.1:4318) "
        "(default: tracing off)",
    )


def _add_engine_and_model_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--worker-url",
        action="append",
        metavar="URL",
        help="engine worker: grpc://host:port, or http://host:port for an OpenAI-compatible server (repeatable)",
    )
    g.add_argument(
        "--worker-urls",
        action=AliasAction,
        alias_of="--worker-url",
        dest="worker_url",
        metavar="URL",
        help="several --worker-url at once, separated by spaces or commas (SMG's spelling)",
    )
    g.add_argument(
        "--prefill", action="append", metavar="URL", help="prefill worker for PD disaggregation (repeatable)"
    )
    g.add_argument(
        "--decode", action="append", metavar="URL", help="decode worker for PD disaggregation (repeatable)"
    )
    g.add_argument(
        "--engine",
        default="auto",
        choices=["auto", *ENGINE_PROTOCOLS],
        help="engine gRPC protocol (auto: detected on the worker's first probe)",
    )
    g.add_argument(
        "--bootstrap-port",
        type=int,
        default=8998,
        help="PD bootstrap port when a prefill worker does not report one",
    )
    g.add_argument(
        "--stream-interval",
        default="auto",
        metavar="N|auto|engine",
        help="ask SGLang engines for one streamed message per N tokens (fewer messages, coarser deltas); "
        "'auto' sends as many tokens per message as the engine decodes in 10 ms, more while the "
        "gateway itself is saturated; 'engine' leaves the engine's own setting",
    )
    g.add_argument(
        "--first-token-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for an engine's first output",
    )
    g.add_argument(
        "--request-timeout",
        "--request-timeout-secs",
        type=float,
        default=1800.0,
        metavar="S",
        help="seconds one engine request may take in total",
    )
    g.add_argument(
        "--demo",
        action="store_true",
        help="also start a simulated gpt-oss engine on a free port and print examples",
    )
    g.add_argument(
        "--harmony-models",
        action="append",
        metavar="NAMES",
        help="models to treat as Harmony (comma-separated; repeatable)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients use, whatever name the engines report (vLLM's option); every worker "
        "must then serve the same model (default: the engines' names)",
    )
    g.add_argument(
        "--tokenizer",
        "--tokenizer-path",
        action="append",
        metavar="[MODEL=]DIR",
        help="local tokenizer folder for a non-Harmony model; a DIR without MODEL= serves every model "
        "without one of its own (repeatable)",
    )
    g.add_argument(
        "--reasoning-parser",
        action="append",
        metavar="MODEL=NAME",
        help="reasoning parser for a non-Harmony model (think)",
    )
    g.add_argument(
        "--tool-call-parser",
        action="append",
        metavar="MODEL=NAME",
        help="tool-call parser for a non-Harmony model (json)",
    )
    g.add_argument(
        "--text-parser",
        action="append",
        metavar="MODEL=KIND",
        help="text output parser for a model behind an HTTP upstream: harmony, think, marker, "
        "passthrough or off (docs/models.md)",
    )
    g.add_argument(
        "--text-parser-window-chars",
        type=int,
        default=256,
        metavar="N",
        help="the Harmony text parser falls back to the ===FINAL=== marker, then pass-through, when no "
        "channel marker appears in the first N characters",
    )
    g.add_argument(
        "--text-parser-window-seconds",
        type=float,
        default=None,
        metavar="S",
        help="... or within S seconds of the first output chunk (default: no time limit)",
    )
    g.add_argument(
        "--model-alias",
        action="append",
        metavar="NAME=MODEL",
        help="serve MODEL under NAME too on /v1/messages (e.g. a Claude model name Claude Code asks for)",
    )
    g.add_argument(
        "--conversation-date",
        default=None,
        help="pin the Harmony conversation start date (YYYY-MM-DD) (default: today, UTC)",
    )
    g.add_argument(
        "--reasoning-fields",
        default="both",
        choices=["both", "reasoning_content", "reasoning"],
        help="which reasoning field(s) chat responses carry",
    )
    g.add_argument(
        "--unbacked-tools",
        choices=("drop", "reject"),
        default="drop",
        help="hosted tools nothing backs (web_search without a browser server, file_search, ...): "
        "leave them out of the prompt (drop) or answer 400 (reject)",
    )
    g.add_argument(
        "--mcp-config", default=None, metavar="FILE", help="YAML file of gateway-configured MCP servers"
    )
    g.add_argument("--mcp-tool-timeout", type=float, default=30.0, help="seconds an MCP tool call may take")
    g.add_argument(
        "--mcp-max-output-chars", type=int, default=64_000, help="cap on tool output fed back to the model"
    )
    g.add_argument(
        "--max-tool-calls", type=int, default=10, help="limit on gateway-executed tool calls per response"
    )


def _add_discovery_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--worker-dns",
        action="append",
        metavar="URL",
        help="a worker for each address of a DNS name: grpc://NAME:PORT (A and AAAA records) or "
        "grpc+srv://NAME (SRV records give targets and ports, e.g. grpc+srv://_grpc._tcp.engines.ns.svc"
        ".cluster.local); grpcs:// alike; ?kind=prefill|decode and ?engine=NAME set the workers' kind and "
        "protocol (repeatable)",
    )
    g.add_argument(
        "--worker-dns-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between lookups; an address missing from two answers in a row drains",
    )
    g.add_argument(
        "--worker-dns-timeout", type=float, default=2.0, metavar="S", help="seconds one DNS lookup may take"
    )
    g.add_argument(
        "--worker-dns-server",
        default=None,
        metavar="ADDRESS[:PORT]",
        help="ask this nameserver (default: the system's, from /etc/resolv.conf, with its search list)",
    )
    g.add_argument(
        "--worker-dns-drain-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a worker gone from DNS may finish its requests in flight before it is removed "
        "(default: --request-timeout)",
    )


def _add_routing_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--policy",
        default="round_robin",
        help="routing policy: round_robin, random, power_of_two, cache_aware, kv_aware, consistent_hash",
    )
    g.add_argument(
        "--model-policy",
        action="append",
        metavar="MODEL=POLICY",
        help="per-model policy override (repeatable)",
    )
    g.add_argument("--prefill-policy", default=None, help="policy for the prefill pool (default: --policy)")
    g.add_argument("--decode-policy", default=None, help="policy for the decode pool (default: --policy)")
    g.add_argument(
        "--cache-key",
        default="tokens",
        choices=["tokens", "selection-text"],
        help="what cache_aware matches on",
    )
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=0.5,
        help="cache_aware: share of the prompt (0-1) a cached prefix must cover to pick the worker",
    )
    g.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=32,
        help="cache_aware, kv_aware: load is skewed when a worker has more than this many requests "
        "above the least loaded...",
    )
    g.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        help="...and more than this many times its count; cache_aware then sends to the least-loaded "
        "worker, kv_aware takes the skewed worker's cache affinity away",
    )
    g.add_argument(
        "--kv-overlap-weight",
        type=float,
        default=1.0,
        help="kv_aware: weight of the prefill tokens a worker would do (uncached prompt plus its queue) "
        "in its cost; 0 balances on load alone",
    )
    g.add_argument(
        "--kv-queue-weight",
        type=float,
        default=0.25,
        help="kv_aware: weight of the uncached prompt tokens already queued on a worker, against the "
        "prefix it holds; below 1 a session's turn waits behind a queue rather than recompute its "
        "context elsewhere",
    )
    g.add_argument(
        "--kv-decode-weight",
        type=float,
        default=1024.0,
        metavar="TOKENS",
        help="kv_aware: prefill tokens one request running or waiting on a worker weighs in its cost",
    )
    g.add_argument(
        "--kv-load-max-age",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="kv_aware: an engine's load record older than this is not read (the gateway's in-flight "
        "count is)",
    )
    g.add_argument(
        "--kv-pressure-threshold",
        type=float,
        default=0.9,
        help="kv_aware: a worker whose KV usage (0-1) is above this gives up its cache affinity; 1 "
        "turns the rule off",
    )
    g.add_argument(
        "--kv-temperature",
        type=float,
        default=0.0,
        help="kv_aware: draw workers with softmax over normalised costs at this temperature (0: the "
        "least cost always wins)",
    )
    g.add_argument(
        "--kv-events",
        default="auto",
        choices=["auto", "off"],
        help="follow the KV-cache events and load records of the engines that publish them "
        "(SubscribeKvEvents: a prefix index per worker, pushed loads), or poll loads only (off)",
    )
    g.add_argument(
        "--kv-index-max-blocks",
        type=positive_int,
        default=DEFAULT_MAX_BLOCKS,
        metavar="N",
        help="blocks one worker's KV index holds at most; past it the least recently used go first",
    )
    g.add_argument(
        "--engine-wedge-ms",
        type=float,
        default=20_000.0,
        metavar="MS",
        help="an engine that reports no output for this long while the gateway has requests on it takes "
        "no traffic until it speaks again (0: never)",
    )
    g.add_argument(
        "--engine-prefill-rate",
        type=float,
        default=2_000.0,
        metavar="TOKENS/S",
        help="prompt tokens a second a healthy engine prefills at least: its pending prefill lengthens "
        "the wedge bound by that much",
    )
    g.add_argument(
        "--load-poll-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="poll an engine's load (GetLoads) every S seconds while it pushes no load records (0: never)",
    )
    g.add_argument(
        "--max-retries",
        "--retry-max-retries",
        type=int,
        default=2,
        help="retries on another worker for requests that fail before the first token",
    )
    g.add_argument(
        "--health-interval",
        "--health-check-interval-secs",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between health checks; an unreachable worker is tried again after this, then after "
        "twice as long each time, up to a minute",
    )
    g.add_argument(
        "--health-timeout",
        "--health-check-timeout-secs",
        type=float,
        default=2.0,
        metavar="S",
        help="health check timeout in seconds",
    )
    g.add_argument(
        "--health-failure-threshold", type=int, default=3, help="failed checks before a worker is marked down"
    )
    g.add_argument(
        "--health-success-threshold", type=int, default=2, help="passed checks before a worker is marked up"
    )
    g.add_argument(
        "--breaker-failure-threshold",
        "--cb-failure-threshold",
        type=int,
        default=5,
        help="consecutive request failures that open a worker's circuit breaker",
    )
    g.add_argument(
        "--breaker-cooldown",
        "--cb-timeout-duration-secs",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds before an open breaker lets a trial request through",
    )


def _add_storage_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help="memory://, sqlite:///path or postgresql://... (default: a file in the user data dir)",
    )
    g.add_argument("--storage-schema", default=None, help="PostgreSQL schema for the gateway's tables")
    g.add_argument(
        "--storage-retention",
        type=float,
        default=None,
        metavar="SECONDS",
        help="purge stored responses older than this (default: kept)",
    )
    g.add_argument(
        "--max-conversation-items",
        type=positive_int,
        default=DEFAULT_MAX_CONVERSATION_ITEMS,
        metavar="N",
        help="items one conversation may hold; an append past it is a 400 (default: %(default)s; OpenAI "
        "documents 20 per call and no total)",
    )
    g.add_argument(
        "--max-conversation-bytes",
        type=positive_int,
        default=DEFAULT_MAX_CONVERSATION_BYTES,
        metavar="N",
        help="bytes of items (as stored JSON) one conversation may hold; an append past it is a 400 "
        "(default: %(default)s, 8 MiB)",
    )


def _add_limits_and_traffic_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--max-body-bytes",
        "--max-payload-size",
        type=int,
        default=8 * 1024 * 1024,
        metavar="N",
        help="largest request body accepted; larger ones get 413 before they are read "
        "(default: %(default)s, 8 MiB)",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a client has to send a request's head (request line and headers); then 408",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds the gateway waits for each piece of a request body; then 408",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds an idle keep-alive connection stays open",
    )
    g.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 * 1024,
        metavar="N",
        help="largest total size of a request's header names and values; above it 431 "
        "(default: %(default)s, 64 KiB)",
    )
    g.add_argument(
        "--max-headers",
        type=int,
        default=128,
        metavar="N",
        help="most headers one request may carry; above it 431",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="open connections above which new requests get 503 (default: no cap but the open-file "
        "limit, which start-up raises to its hard maximum)",
    )
    g.add_argument(
        "--max-parse-tokens",
        type=int,
        default=131_072,
        metavar="N",
        help="most token ids POST /v1/harmony/parse reads; more are a 400",
    )
    g.add_argument(
        "--max-batch-size",
        type=positive_int,
        default=64,
        help="samples one /generate or /v1/completions batch may ask for, prompts × n",
    )
    g.add_argument(
        "--batch-concurrency",
        type=positive_int,
        default=8,
        help="sub-requests of one batch at the engines at once",
    )
    g.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests running at once, for the whole gateway: generations, render, parse, token "
        "counting and writes (reads, cancels and deletes take no slot; default: no cap)",
    )
    g.add_argument(
        "--queue-size",
        type=int,
        default=64,
        metavar="M",
        help="requests that may wait for a slot",
    )
    g.add_argument(
        "--queue-timeout",
        "--queue-timeout-secs",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a request may wait for a slot before a 429",
    )
    g.add_argument(
        "--rate-limit",
        type=int,
        default=None,
        metavar="R",
        help="requests per minute per API key (per client address when no keys are configured); reads "
        "count a tenth, render/parse/count_tokens and writes more with a bigger body (default: unlimited)",
    )
    g.add_argument(
        "--token-rate-limit",
        type=int,
        default=None,
        metavar="T",
        help="prompt + completion tokens per minute per API key (or client address); a generation "
        "reserves its estimated prompt plus max_tokens (or 1024) at admission, settled when it ends "
        "(default: unlimited)",
    )
    g.add_argument(
        "--rate-limit-store",
        default=None,
        metavar="URL",
        help="redis://host:port/db: keep rate-limit budgets in Redis, shared by every replica "
        "(default: per process)",
    )
    g.add_argument(
        "--drain-timeout",
        "--shutdown-grace-period-secs",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, seconds in-flight requests may take to finish",
    )


def _add_websocket_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--ws-max-message-bytes",
        type=positive_int,
        default=8 * 1024 * 1024,
        metavar="N",
        help="largest message a client may send on a Responses WebSocket; a larger one closes the socket "
        "with 1009 before it is read (default: %(default)s, 8 MiB)",
    )
    g.add_argument(
        "--ws-idle-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds a socket may stay open with no turn running and no client event received (pings "
        "do not count); then it is closed (1000)",
    )
    g.add_argument(
        "--ws-max-turns",
        type=positive_int,
        default=1000,
        metavar="N",
        help="response.create turns one socket may run; the next one is refused with an error event "
        "(websocket_connection_limit_reached) and the socket closes",
    )
    g.add_argument(
        "--ws-max-lifetime",
        type=float,
        default=3600.0,
        metavar="S",
        help="seconds a socket may live; a turn asked for later is refused as past --ws-max-turns is",
    )
    g.add_argument(
        "--ws-max-sockets-per-key",
        type=positive_int,
        default=64,
        metavar="N",
        help="open sockets one API key (one client address without keys) may hold; a handshake past it "
        "gets 429",
    )


def _add_security_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require this bearer key on /v1 routes (repeatable); prefer --api-key-file or "
        "HARMONY_GATEWAY_API_KEY: the command line is visible in the process list",
    )
    g.add_argument(
        "--api-keys",
        action=AliasAction,
        alias_of="--api-key",
        dest="api_key",
        metavar="KEY",
        help="several --api-key at once, separated by spaces or commas",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="file with one API key per line, optionally with rate_limit=R token_rate_limit=T priority=P "
        "tenant=NAME (keys of one tenant share stored responses and conversations); read again when it "
        "changes and on SIGHUP, without a restart",
    )
    g.add_argument(
        "--admin-key",
        action="append",
        metavar="KEY",
        help="bearer key for the admin plane: /workers, and /metrics and /docs with --protect-metrics "
        "(repeatable); tenant --api-key keys never open it",
    )
    g.add_argument(
        "--admin-host",
        default="127.0.0.1",
        help="address of the admin listener started by --admin-port",
    )
    g.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="serve the admin routes on this separate port only (the main port then refuses them) "
        "(default: no admin listener)",
    )
    g.add_argument(
        "--worker-allow-hosts",
        action="append",
        metavar="HOSTS",
        help="the only hosts a worker registered with POST /workers may name (comma-separated names, "
        "addresses or CIDR networks) (default: any but link-local and cloud metadata addresses, which "
        "are refused always)",
    )
    g.add_argument(
        "--mcp-allow-hosts",
        action="append",
        metavar="HOSTS",
        help="hosts MCP server_url may resolve to even if private (comma-separated)",
    )
    g.add_argument(
        "--protect-metrics",
        action="store_true",
        help="/metrics, /docs and /openapi.json require the admin credential",
    )
    g.add_argument(
        "--forwarded-allow-ips",
        action="append",
        metavar="IPS",
        help="comma-separated IPs or CIDRs of proxies whose X-Forwarded-For/-Proto are trusted for the "
        "client address ('*': every peer; repeatable) (default: none, the peer's own address counts)",
    )
    reasoning_key = g.add_mutually_exclusive_group()
    reasoning_key.add_argument(
        "--reasoning-key-file",
        default=None,
        metavar="PATH",
        help="file holding the key for encrypted reasoning and thinking signatures (surrounding "
        "whitespace ignored); or set HARMONY_GATEWAY_REASONING_KEY (default: generated once and kept "
        "in the storage)",
    )
    reasoning_key.add_argument(
        "--reasoning-key",
        default=None,
        metavar="SECRET",
        help="the same key given inline; discouraged: the command line is visible to every local user "
        "in the process list (ps), so prefer --reasoning-key-file or HARMONY_GATEWAY_REASONING_KEY",
    )


def _stream_interval(value: str) -> int | None:
    if value == "engine":
        return None
    if value == "auto":
        return 0
    if not value.isdigit() or int(value) < 1:
        raise StartupError(
            f"--stream-interval {value}: expects a positive number, 'auto' or 'engine'", "stream_interval"
        )
    return int(value)


def _key_file(args: argparse.Namespace) -> dict[str, KeyPolicy]:
    """The key file's entries: key → `KeyPolicy` (its own limits and priority, if any)."""
    path = args.api_key_file
    if not path:
        return {}
    try:
        entries = read_key_file(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise StartupError(f"--api-key-file {path}: cannot read it: {exc}", "api_key_file") from None
    except ValueError as exc:
        raise StartupError(f"--api-key-file {exc}", "api_key_file") from None
    if not entries:
        # A gateway given a key file means to require keys: an empty one must not open it to everyone.
        raise StartupError(f"--api-key-file {path}: holds no key", "api_key_file")
    return entries


def _reasoning_key(args: argparse.Namespace) -> str | None:
    """The reasoning key: --reasoning-key-file, else --reasoning-key (HARMONY_GATEWAY_REASONING_KEY)."""
    path = args.reasoning_key_file
    if path:
        try:
            key = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise StartupError(
                f"--reasoning-key-file {path}: cannot read it: {exc}", "reasoning_key_file"
            ) from None
        if not key:
            raise StartupError(f"--reasoning-key-file {path}: is empty", "reasoning_key_file")
        return key
    return args.reasoning_key or None


def visible_secret_warning(args: argparse.Namespace) -> str | None:
    """Why the command line is a poor place for a secret that was given on it, or None (a secret from
    the environment or the config file is not in the process list)."""
    sources = getattr(args, "option_sources", {})
    if args.reasoning_key and sources.get("reasoning_key", "--reasoning-key").startswith("--"):
        return (
            "--reasoning-key is visible to every local user in the process list (ps); "
            "use --reasoning-key-file or HARMONY_GATEWAY_REASONING_KEY instead"
        )
    return None


#: Settings fields made of a repeatable `MODEL=VALUE` option (a dict, by model).
_PAIR_OPTIONS = {
    "model_policies": "--model-policy",
    "reasoning_parsers": "--reasoning-parser",
    "tool_call_parsers": "--tool-call-parser",
    "model_aliases": "--model-alias",
    "text_parsers": "--text-parser",
}
#: Settings fields made of a repeatable, comma-separated option of the same name (a tuple).
_LIST_OPTIONS = ("forwarded_allow_ips", "worker_allow_hosts", "mcp_allow_hosts")
_SETTINGS_FIELDS = frozenset(f.name for f in fields(Settings))
#: `--tokenizer DIR` without a model: the tokenizer of every model without one of its own.
ANY_MODEL = "*"


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The Settings of parsed `serve` options (the parser has added the environment's and the config
    file's, cli/config.py) and the key files they name. An option named like a Settings field sets it as
    parsed; the others are converted here.

    Raises StartupError on an unreadable or empty key file or a malformed `MODEL=VALUE` flag.
    """
    options = vars(args)
    as_parsed = {name: value for name, value in options.items() if name in _SETTINGS_FIELDS}
    key_policies = _key_file(args)
    converted: dict[str, Any] = {
        "worker_urls": tuple(args.worker_url or ()),
        "prefill_urls": tuple(args.prefill or ()),
        "decode_urls": tuple(args.decode or ()),
        "worker_dns": tuple(args.worker_dns or ()),
        "harmony_models": frozenset(split_list(args.harmony_models)),
        "processes": args.workers,
        "stream_interval": _stream_interval(args.stream_interval),
        "timeouts": Timeouts(first_token=args.first_token_timeout, total=args.request_timeout),
        "conversation_start_date": args.conversation_date,
        "storage_url": args.storage,
        "api_keys": frozenset(args.api_key or ()) | frozenset(key_policies),
        "admin_keys": frozenset(args.admin_key or ()),
        "reasoning_key": _reasoning_key(args),
        "key_policies": key_policies,
        "tokenizer_paths": _tokenizers(args.tokenizer),
    }
    for name, option in _PAIR_OPTIONS.items():
        try:
            converted[name] = pairs(options[option[2:].replace("-", "_")], option)
        except ValueError as exc:
            raise StartupError(str(exc), option[2:].replace("-", "_")) from None
    for name in _LIST_OPTIONS:
        converted[name] = tuple(split_list(options[name]))
    return Settings(**(as_parsed | converted))


def _tokenizers(values: list[str] | None) -> dict[str, str]:
    """`--tokenizer MODEL=DIR` by model; a bare `DIR` serves any model (`ANY_MODEL`)."""
    out: dict[str, str] = {}
    for value in values or ():
        model, sep, folder = value.rpartition("=")
        out[model.strip() if sep else ANY_MODEL] = folder.strip()
    return out


def invalid_setting(settings: Settings) -> str | None:
    """A one-line reason the settings cannot work (an unknown policy or parser, a number out of range,
    a URL without its scheme...), or None; reads no file (`checks.setting_problem`)."""
    problem = setting_problem(settings)
    return None if problem is None else str(problem)


def fail(message: str) -> NoReturn:
    """End start-up: the reason on one line of stderr, exit status 2."""
    print(f"harmony-gateway: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def run(args: argparse.Namespace, argv: list[str]) -> None:
    """Serve until stopped. Anything that keeps the gateway from starting (settings, files, the
    storage, the port) exits 2 with one line on stderr, before the port is bound and before the banner;
    `argv` is the command line, handed to the processes of `--workers N`."""
    sources: dict[str, str] = getattr(args, "option_sources", {})
    try:
        settings = settings_from_args(args)
    except StartupError as exc:
        fail(exc.describe(sources))
    configure_logging(settings.log_level, settings.log_json)
    for warning in getattr(args, "config_warnings", ()):
        log.warning(warning)
    warning = visible_secret_warning(args)
    if warning:
        log.warning(warning)
    problem = setting_problem(settings) or file_problem(settings)
    if problem:
        fail(problem.describe(sources))
    # lazy: loads the serving stack and the vocabularies; the other commands and --help never need them
    from ..app import load_vocabularies
    from ..harmony.encoding import VocabularyUnavailable

    try:
        load_vocabularies()  # fail fast, before binding the port
    except VocabularyUnavailable as exc:
        fail(str(exc))
    if not settings.worker_urls and not settings.prefill_urls and not settings.worker_dns and not args.demo:
        fail("no workers: pass --worker-url grpc://host:port, --worker-dns grpc://name:port (or --demo)")
    try:
        check_resolver(settings)
        if args.workers > 1:
            reason = _multiprocess_problem(settings, args.demo)
            if reason:
                fail(f"--workers {args.workers}: {reason}")
            _serve_processes(settings, argv, args.workers)
            return
        run_until_interrupted(_serve(settings, args.demo))
    except StartupError as exc:
        fail(exc.describe(sources))


async def _serve(settings: Settings, demo: bool) -> None:
    # The serving stack loads only when serve runs, so --help and the other commands start fast.
    import uvicorn  # lazy: serving stack

    from ..api.http_protocol import raise_open_file_limit, server_options  # lazy: serving stack (uvicorn)
    from ..app import create_app  # lazy: serving stack (FastAPI, pipeline, storage)
    from ..traffic.drain import DrainingServer  # lazy: serving stack (uvicorn)

    class Server(DrainingServer):
        """Runs `started` once it listens and its lifespan has started the app: the banner and the
        lines that say what started come after the port is bound, never before a failure."""

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                started()

    await check_storage(settings)
    # Bound now, so a port in use is one line before anything starts; the server listens on them.
    sock = bind_listener(settings.host, settings.port)
    admin_sock = None
    try:
        if settings.admin_port is not None:
            admin_sock = bind_listener(settings.admin_host, settings.admin_port, "admin_port", "admin_host")
    except StartupError:
        sock.close()
        raise
    url = listen_url(settings, sock)
    admin_url = listen_url(replace(settings, host=settings.admin_host), admin_sock) if admin_sock else None
    sim = None
    if demo:
        # lazy: the simulated engine loads only for --demo, not in every gateway
        from ..sim import SimConfig, start_sim_engine

        sim = await start_sim_engine(SimConfig(host="127.0.0.1", port=0, tokens_per_second=200.0))
        settings = replace(settings, worker_urls=settings.worker_urls + (sim.url,))
    app = create_app(settings)
    raise_open_file_limit()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=sock.getsockname()[1],
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        log_config=None,
        **server_options(settings),
    )

    def started() -> None:
        for line in started_lines(settings, url, admin_url):
            log.info(line)
        if sim is not None:  # demo mode: the examples, once the gateway answers them
            host, port = url.split("://", 1)[1].rsplit(":", 1)
            key = min(settings.api_keys) if settings.api_keys else None
            print(demo_banner(host=host, port=int(port), sim_url=sim.url, api_key=key), flush=True)

    server = Server(config)
    try:
        if admin_sock is None:
            await server.serve(sockets=[sock])
        else:
            await _serve_with_admin_listener(server, app, settings, sock, admin_sock)
    finally:
        sock.close()
        if admin_sock is not None:
            admin_sock.close()
        if sim is not None:
            await sim.stop()


async def _serve_with_admin_listener(
    server: uvicorn.Server, app: FastAPI, settings: Settings, sock: socket.socket, admin_sock: socket.socket
) -> None:
    # lazy: the admin routes import the HTTP app's modules (FastAPI); only --admin-port needs them
    from ..api.admin import admin_server

    admin = admin_server(app, settings.admin_host, admin_sock.getsockname()[1], settings.log_level)
    # The admin listener answers 503 until the main server's lifespan has built the app's state.
    admin_task = asyncio.create_task(admin.serve(sockets=[admin_sock]))
    try:
        await server.serve(sockets=[sock])
    finally:
        admin.should_exit = True
        await admin_task


def _multiprocess_problem(settings: Settings, demo: bool) -> str | None:
    if demo:
        return "--demo runs in one process"
    if settings.admin_port is not None:
        return "the admin listener (--admin-port) runs in one process; use --admin-key instead"
    url = settings.storage_url or ""
    if url.startswith("memory:"):
        # Each process would keep its own responses and conversations: a follow-up that lands on
        # another process would not find them.
        return "memory:// storage is per process; use sqlite:///PATH or postgresql://..."
    return None


def _serve_processes(settings: Settings, argv: list[str], workers: int) -> None:
    """uvicorn's supervisor: N spawned processes accept on one listening socket, bound here (a port in
    use is one line); each builds its app from the same command line (`harmony_gateway.cli.app_from_env`)."""
    # The serving stack loads only when serve runs, so --help and the other commands start fast.
    import uvicorn  # lazy: serving stack
    from uvicorn.supervisors import Multiprocess  # lazy: serving stack

    from ..api.http_protocol import raise_open_file_limit, server_options  # lazy: serving stack (uvicorn)
    from ..traffic.drain import use_draining_processes  # lazy: serving stack (uvicorn)

    asyncio.run(check_storage(settings))
    sock = bind_listener(settings.host, settings.port)
    os.environ[SERVE_ARGV_ENV] = json.dumps(argv)
    raise_open_file_limit()  # the spawned processes inherit it
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # /metrics must add up every process's counters, whichever process answers the scrape.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="harmony-gateway-metrics-")
    if settings.max_concurrent_requests:
        # One admission cap for all processes: slots are byte-range locks on this file (traffic.admission).
        # lazy: the app module pulls in the HTTP stack and prometheus_client, which must load after
        # PROMETHEUS_MULTIPROC_DIR is set
        from ..app import SHARED_SLOTS_ENV

        os.environ[SHARED_SLOTS_ENV] = os.path.join(
            tempfile.mkdtemp(prefix="harmony-gateway-admission-"), "slots"
        )
    use_draining_processes()
    config = uvicorn.Config(
        "harmony_gateway.cli:app_from_env",
        factory=True,
        host=settings.host,
        port=sock.getsockname()[1],
        workers=workers,
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        log_config=None,
        **server_options(settings, processes=workers),
    )
    for line in started_lines(settings, listen_url(settings, sock)):
        log.info(line)
    log.info("%d gateway processes share the port", workers)
    try:
        Multiprocess(config, sockets=[sock]).run()
    finally:
        sock.close()
