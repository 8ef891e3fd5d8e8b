"""Command line: `harmony-gateway serve | sim-engine | vocab | render`. Every command has --help."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from .settings import Settings, Timeouts
from .storage.base import DEFAULT_MAX_CONVERSATION_BYTES, DEFAULT_MAX_CONVERSATION_ITEMS

log = logging.getLogger("harmony_gateway")


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # uvloop is optional on platforms without it
        runner = asyncio.Runner()
    with runner, _quiet_interrupt():
        runner.run(coro)


class _quiet_interrupt:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return exc_type is KeyboardInterrupt


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _split_list(values: Sequence[str] | None) -> list[str]:
    out: list[str] = []
    for value in values or ():
        out.extend(v.strip() for v in value.split(",") if v.strip())
    return out


def _pairs(values: Sequence[str] | None, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values or ():
        if "=" not in value:
            raise SystemExit(f"{flag} expects MODEL=VALUE, got {value!r}")
        key, val = value.split("=", 1)
        out[key.strip()] = val.strip()
    return out


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return number


def _stream_interval(value: str) -> int | None:
    if value == "engine":
        return None
    if value == "auto":
        return 0
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"--stream-interval expects a positive number, 'auto' or 'engine', got {value!r}")
    return int(value)


def _key_file(args: argparse.Namespace) -> dict[str, Any]:
    """The key file's entries: key → `KeyPolicy` (its own limits and priority, if any)."""
    if not args.api_key_file:
        return {}
    from .traffic.keys import read_key_file

    try:
        return read_key_file(args.api_key_file)
    except ValueError as exc:
        raise SystemExit(f"harmony-gateway: {exc}") from None


def _api_keys(args: argparse.Namespace) -> frozenset[str]:
    keys = set(args.api_key or ())
    keys.update(_key_file(args))
    env = os.environ.get("HARMONY_GATEWAY_API_KEYS")
    if env:
        keys.update(k.strip() for k in env.split(",") if k.strip())
    return frozenset(keys)


def _admin_keys(args: argparse.Namespace) -> frozenset[str]:
    keys = set(args.admin_key or ())
    env = os.environ.get("HARMONY_GATEWAY_ADMIN_KEYS")
    if env:
        keys.update(k.strip() for k in env.split(",") if k.strip())
    return frozenset(keys)


def _reasoning_key(args: argparse.Namespace) -> str | None:
    """The reasoning key: --reasoning-key-file, else --reasoning-key, else HARMONY_GATEWAY_REASONING_KEY."""
    if args.reasoning_key_file:
        try:
            key = Path(args.reasoning_key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"harmony-gateway: --reasoning-key-file: cannot read it: {exc}") from None
        if not key:
            raise SystemExit(f"harmony-gateway: --reasoning-key-file: {args.reasoning_key_file} is empty")
        return key
    return args.reasoning_key or os.environ.get("HARMONY_GATEWAY_REASONING_KEY") or None


def visible_secret_warning(args: argparse.Namespace) -> str | None:
    """Why the command line is a poor place for a secret that was given on it, or None."""
    if args.reasoning_key:
        return (
            "--reasoning-key is visible to every local user in the process list (ps); "
            "use --reasoning-key-file or HARMONY_GATEWAY_REASONING_KEY instead"
        )
    return None


def settings_from_args(args: argparse.Namespace) -> Settings:
    harmony_models = _split_list(args.harmony_models) + _split_list([os.environ.get("HARMONY_MODELS", "")])
    return Settings(
        host=args.host,
        port=args.port,
        worker_urls=tuple(args.worker_url or ()),
        prefill_urls=tuple(args.prefill or ()),
        decode_urls=tuple(args.decode or ()),
        engine=args.engine,
        harmony_models=frozenset(harmony_models),
        policy=args.policy,
        model_policies=_pairs(args.model_policy, "--model-policy"),
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        cache_key=args.cache_key,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        bootstrap_port=args.bootstrap_port,
        processes=args.workers,
        max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_header_bytes=args.max_header_bytes,
        max_headers=args.max_headers,
        max_connections=args.max_connections,
        forwarded_allow_ips=tuple(_split_list(args.forwarded_allow_ips)),
        max_parse_tokens=args.max_parse_tokens,
        max_retries=args.max_retries,
        max_batch_size=args.max_batch_size,
        batch_concurrency=args.batch_concurrency,
        stream_interval=_stream_interval(args.stream_interval),
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        health_failure_threshold=args.health_failure_threshold,
        health_success_threshold=args.health_success_threshold,
        breaker_failure_threshold=args.breaker_failure_threshold,
        breaker_cooldown=args.breaker_cooldown,
        timeouts=Timeouts(first_token=args.first_token_timeout, total=args.request_timeout),
        conversation_start_date=args.conversation_date,
        reasoning_fields=args.reasoning_fields,
        storage_url=args.storage,
        storage_schema=args.storage_schema,
        storage_retention=args.storage_retention,
        max_conversation_items=args.max_conversation_items,
        max_conversation_bytes=args.max_conversation_bytes,
        api_keys=_api_keys(args),
        admin_keys=_admin_keys(args),
        admin_host=args.admin_host,
        admin_port=args.admin_port,
        worker_allow_hosts=tuple(_split_list(args.worker_allow_hosts)),
        protect_metrics=args.protect_metrics,
        log_level=args.log_level,
        log_json=args.log_json,
        log_prompts=args.log_prompts,
        mcp_config=args.mcp_config,
        mcp_allow_hosts=tuple(_split_list(args.mcp_allow_hosts)),
        mcp_tool_timeout=args.mcp_tool_timeout,
        mcp_max_output_chars=args.mcp_max_output_chars,
        max_tool_calls=args.max_tool_calls,
        unbacked_tools=args.unbacked_tools,
        reasoning_key=_reasoning_key(args),
        tokenizer_paths=_pairs(args.tokenizer, "--tokenizer"),
        reasoning_parsers=_pairs(args.reasoning_parser, "--reasoning-parser"),
        tool_call_parsers=_pairs(args.tool_call_parser, "--tool-call-parser"),
        model_aliases=_pairs(args.model_alias, "--model-alias"),
        text_parsers=_pairs(args.text_parser, "--text-parser"),
        text_parser_window_chars=args.text_parser_window_chars,
        text_parser_window_seconds=args.text_parser_window_seconds,
        max_concurrent_requests=args.max_concurrent_requests,
        queue_size=args.queue_size,
        queue_timeout=args.queue_timeout,
        rate_limit=args.rate_limit,
        token_rate_limit=args.token_rate_limit,
        rate_limit_store=args.rate_limit_store,
        key_policies=_key_file(args),
        drain_timeout=args.drain_timeout,
        otlp_endpoint=args.otlp_endpoint,
    )


def invalid_setting(settings: Settings) -> str | None:
    """A one-line reason the settings cannot work (unknown policy or parser name), or None."""
    from .errors import InvalidRequest
    from .pipeline.output_parsers.registry import validate_parser_names
    from .routing.cache_aware import CacheAwarePolicy
    from .routing.registry import POLICIES

    for name in (
        settings.policy,
        settings.prefill_policy,
        settings.decode_policy,
        *settings.model_policies.values(),
    ):
        if name is not None and name not in POLICIES:
            return f"unknown routing policy {name!r}; expected one of {', '.join(sorted(POLICIES))}"
    try:
        CacheAwarePolicy(**settings.policy_options("cache_aware"))
    except ValueError as exc:
        return str(exc)
    try:
        validate_parser_names(settings.reasoning_parsers, settings.tool_call_parsers, settings.text_parsers)
    except InvalidRequest as exc:
        return exc.message
    if settings.text_parser_window_chars < 0:
        return "--text-parser-window-chars must be 0 or more"
    if settings.text_parser_window_seconds is not None and settings.text_parser_window_seconds <= 0:
        return "--text-parser-window-seconds must be above 0"
    for flag, value in (
        ("--max-concurrent-requests", settings.max_concurrent_requests),
        ("--rate-limit", settings.rate_limit),
        ("--token-rate-limit", settings.token_rate_limit),
    ):
        if value is not None and value < 1:
            return f"{flag} must be 1 or more"
    if settings.queue_size < 0 or settings.queue_timeout <= 0 or settings.drain_timeout < 0:
        return "--queue-size and --drain-timeout must be 0 or more, --queue-timeout above 0"
    if settings.rate_limit_store and not settings.rate_limit_store.startswith(("redis://", "rediss://")):
        return "--rate-limit-store expects redis://host:port/db"
    for peer in settings.forwarded_allow_ips:
        if peer != "*":
            try:
                ipaddress.ip_network(peer, strict=False)
            except ValueError:
                return f"--forwarded-allow-ips expects IPs, CIDRs or '*', got {peer!r}"
    if settings.protect_metrics and not settings.admin_keys and settings.admin_port is None:
        return "--protect-metrics needs the admin credential: pass --admin-key KEY or --admin-port PORT"
    return None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--worker-url",
        action="append",
        metavar="URL",
        help="engine worker: grpc://host:port, or http://host:port for an OpenAI-compatible server (repeatable)",
    )
    p.add_argument(
        "--prefill", action="append", metavar="URL", help="prefill worker for PD disaggregation (repeatable)"
    )
    p.add_argument(
        "--decode", action="append", metavar="URL", help="decode worker for PD disaggregation (repeatable)"
    )
    p.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "sglang", "vllm", "mlx", "trtllm", "tokenspeed"],
        help="engine gRPC protocol (auto: detected on the worker's first probe)",
    )
    p.add_argument(
        "--harmony-models",
        action="append",
        metavar="NAMES",
        help="models to treat as Harmony (comma-separated; also HARMONY_MODELS)",
    )
    p.add_argument(
        "--policy",
        default="round_robin",
        help="routing policy: round_robin, random, power_of_two, cache_aware, consistent_hash",
    )
    p.add_argument(
        "--model-policy",
        action="append",
        metavar="MODEL=POLICY",
        help="per-model policy override (repeatable)",
    )
    p.add_argument("--prefill-policy", default=None, help="policy for the prefill pool (default: --policy)")
    p.add_argument("--decode-policy", default=None, help="policy for the decode pool (default: --policy)")
    p.add_argument(
        "--cache-key",
        default="tokens",
        choices=["tokens", "selection-text"],
        help="what cache_aware matches on",
    )
    p.add_argument(
        "--cache-threshold",
        type=float,
        default=0.5,
        help="cache_aware: share of the prompt (0-1) a cached prefix must cover to pick the worker",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=32,
        help="cache_aware: send to the least-loaded worker when the busiest has more than this many "
        "in-flight requests above it...",
    )
    p.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=1.5,
        help="...and more than this many times its in-flight requests",
    )
    p.add_argument(
        "--bootstrap-port",
        type=int,
        default=8998,
        help="PD bootstrap port when a prefill worker does not report one",
    )
    p.add_argument(
        "--stream-interval",
        default="auto",
        metavar="N|auto|engine",
        help="ask SGLang engines for one streamed message per N tokens (fewer messages, coarser deltas); "
        "'auto' (default) sends as many tokens per message as the engine decodes in 10 ms, more while the "
        "gateway itself is saturated; 'engine' leaves the engine's own setting",
    )
    p.add_argument(
        "--max-retries",
        type=int,
        default=2,
        help="retries on another worker for requests that fail before the first token",
    )
    p.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=64,
        help="samples one /generate or /v1/completions batch may ask for, prompts × n (default 64)",
    )
    p.add_argument(
        "--batch-concurrency",
        type=_positive_int,
        default=8,
        help="sub-requests of one batch at the engines at once (default 8)",
    )
    p.add_argument("--health-interval", type=float, default=5.0, help="seconds between health checks")
    p.add_argument("--health-timeout", type=float, default=2.0, help="health check timeout in seconds")
    p.add_argument(
        "--health-failure-threshold", type=int, default=3, help="failed checks before a worker is marked down"
    )
    p.add_argument(
        "--health-success-threshold", type=int, default=2, help="passed checks before a worker is marked up"
    )
    p.add_argument(
        "--breaker-failure-threshold",
        type=int,
        default=5,
        help="consecutive request failures that open a worker's circuit breaker",
    )
    p.add_argument(
        "--breaker-cooldown",
        type=float,
        default=30.0,
        help="seconds before an open breaker lets a trial request through",
    )
    p.add_argument(
        "--first-token-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for an engine's first output",
    )
    p.add_argument(
        "--request-timeout", type=float, default=1800.0, help="seconds one engine request may take in total"
    )
    p.add_argument(
        "--conversation-date",
        default=None,
        help="pin the Harmony conversation start date (YYYY-MM-DD); default today (UTC)",
    )
    p.add_argument(
        "--reasoning-fields",
        default="both",
        choices=["both", "reasoning_content", "reasoning"],
        help="which reasoning field(s) chat responses carry",
    )
    p.add_argument(
        "--storage",
        default=None,
        metavar="URL",
        help="memory://, sqlite:///path (default: a file in the user data dir) or postgresql://...",
    )
    p.add_argument("--storage-schema", default=None, help="PostgreSQL schema for the gateway's tables")
    p.add_argument(
        "--storage-retention",
        type=float,
        default=None,
        metavar="SECONDS",
        help="purge stored responses older than this",
    )
    p.add_argument(
        "--max-conversation-items",
        type=_positive_int,
        default=DEFAULT_MAX_CONVERSATION_ITEMS,
        metavar="N",
        help="items one conversation may hold; an append past it is a 400 (default %(default)s; OpenAI "
        "documents 20 per call and no total)",
    )
    p.add_argument(
        "--max-conversation-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_CONVERSATION_BYTES,
        metavar="N",
        help="bytes of items (as stored JSON) one conversation may hold; an append past it is a 400 "
        "(default %(default)s, 8 MiB)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require this bearer key on /v1 routes (repeatable; also HARMONY_GATEWAY_API_KEYS)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="file with one API key per line, optionally with rate_limit=R token_rate_limit=T priority=P "
        "tenant=NAME (keys of one tenant share stored responses and conversations)",
    )
    p.add_argument(
        "--admin-key",
        action="append",
        metavar="KEY",
        help="bearer key for the admin plane: /workers, and /metrics and /docs with --protect-metrics "
        "(repeatable; also HARMONY_GATEWAY_ADMIN_KEYS); tenant --api-key keys never open it",
    )
    p.add_argument(
        "--admin-host",
        default="127.0.0.1",
        help="address of the admin listener started by --admin-port (default 127.0.0.1)",
    )
    p.add_argument(
        "--admin-port",
        type=int,
        default=None,
        help="serve the admin routes on this separate port only (the main port then refuses them)",
    )
    p.add_argument(
        "--worker-allow-hosts",
        action="append",
        metavar="HOSTS",
        help="hosts a worker registered with POST /workers may resolve to even if private or loopback "
        "(comma-separated names, addresses or CIDR networks)",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="/metrics, /docs and /openapi.json require the admin credential",
    )
    p.add_argument(
        "--mcp-config", default=None, metavar="FILE", help="YAML file of gateway-configured MCP servers"
    )
    p.add_argument(
        "--mcp-allow-hosts",
        action="append",
        metavar="HOSTS",
        help="hosts MCP server_url may resolve to even if private (comma-separated)",
    )
    p.add_argument("--mcp-tool-timeout", type=float, default=30.0, help="seconds an MCP tool call may take")
    p.add_argument(
        "--mcp-max-output-chars", type=int, default=64_000, help="cap on tool output fed back to the model"
    )
    p.add_argument(
        "--max-tool-calls", type=int, default=10, help="limit on gateway-executed tool calls per response"
    )
    p.add_argument(
        "--unbacked-tools",
        choices=("drop", "reject"),
        default="drop",
        help="hosted tools nothing backs (web_search without a browser server, file_search, ...): "
        "leave them out of the prompt (drop) or answer 400 (reject)",
    )
    reasoning_key = p.add_mutually_exclusive_group()
    reasoning_key.add_argument(
        "--reasoning-key-file",
        default=None,
        metavar="PATH",
        help="file holding the key for encrypted reasoning and thinking signatures (surrounding "
        "whitespace ignored); or set HARMONY_GATEWAY_REASONING_KEY. Default: generated once and kept in "
        "the storage",
    )
    reasoning_key.add_argument(
        "--reasoning-key",
        default=None,
        metavar="SECRET",
        help="the same key given inline; discouraged: the command line is visible to every local user "
        "in the process list (ps), so prefer --reasoning-key-file or HARMONY_GATEWAY_REASONING_KEY",
    )
    p.add_argument(
        "--tokenizer",
        action="append",
        metavar="MODEL=DIR",
        help="local tokenizer folder for a non-Harmony model",
    )
    p.add_argument(
        "--reasoning-parser",
        action="append",
        metavar="MODEL=NAME",
        help="reasoning parser for a non-Harmony model (think)",
    )
    p.add_argument(
        "--tool-call-parser",
        action="append",
        metavar="MODEL=NAME",
        help="tool-call parser for a non-Harmony model (json)",
    )
    p.add_argument(
        "--text-parser",
        action="append",
        metavar="MODEL=KIND",
        help="text output parser for a model behind an HTTP upstream: harmony, think, marker, "
        "passthrough or off (docs/models.md)",
    )
    p.add_argument(
        "--text-parser-window-chars",
        type=int,
        default=256,
        metavar="N",
        help="the Harmony text parser falls back to the ===FINAL=== marker, then pass-through, when no "
        "channel marker appears in the first N characters (default 256)",
    )
    p.add_argument(
        "--text-parser-window-seconds",
        type=float,
        default=None,
        metavar="S",
        help="... or within S seconds of the first output chunk (default: no time limit)",
    )
    p.add_argument(
        "--model-alias",
        action="append",
        metavar="NAME=MODEL",
        help="serve MODEL under NAME too on /v1/messages (e.g. a Claude model name Claude Code asks for)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests running at once, for the whole gateway: generations, render, parse, token "
        "counting and writes (reads, cancels and deletes take no slot; default: no cap)",
    )
    p.add_argument(
        "--queue-size",
        type=int,
        default=64,
        metavar="M",
        help="requests that may wait for a slot (default 64)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a request may wait for a slot before a 429 (default 30)",
    )
    p.add_argument(
        "--rate-limit",
        type=int,
        default=None,
        metavar="R",
        help="requests per minute per API key (per client address when no keys are configured); reads "
        "count a tenth, render/parse/count_tokens and writes more with a bigger body",
    )
    p.add_argument(
        "--token-rate-limit",
        type=int,
        default=None,
        metavar="T",
        help="prompt + completion tokens per minute per API key (or client address); a generation "
        "reserves its estimated prompt plus max_tokens (or 1024) at admission, settled when it ends",
    )
    p.add_argument(
        "--rate-limit-store",
        default=None,
        metavar="URL",
        help="redis://host:port/db: keep rate-limit budgets in Redis, shared by every replica",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, seconds in-flight requests may take to finish (default 30)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces over OTLP/HTTP to this collector (e.g. http://127.0.0.1:4318)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    p.add_argument("--log-prompts", action="store_true", help="include prompt text in request logs")
    p.add_argument(
        "--demo",
        action="store_true",
        help="also start a simulated gpt-oss engine on a free port and print examples",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="gateway processes sharing the port (default 1); above 1 they share the registered workers, "
        "their health and /metrics through the storage, which must be sqlite or postgresql",
    )
    limits = p.add_argument_group("connection and request limits (see README, Limits)")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        metavar="N",
        help="largest request body accepted; larger ones get 413 before they are read (default 8 MiB)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a client has to send a request's head (request line and headers); then 408 (default 10)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds the gateway waits for each piece of a request body; then 408 (default 30)",
    )
    limits.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    limits.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 * 1024,
        metavar="N",
        help="largest total size of a request's header names and values; above it 431 (default 64 KiB)",
    )
    limits.add_argument(
        "--max-headers",
        type=int,
        default=128,
        metavar="N",
        help="most headers one request may carry; above it 431 (default 128)",
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="open connections above which new requests get 503 (default: no cap but the open-file "
        "limit, which start-up raises to its hard maximum)",
    )
    limits.add_argument(
        "--forwarded-allow-ips",
        action="append",
        metavar="IPS",
        help="comma-separated IPs or CIDRs of proxies whose X-Forwarded-For/-Proto are trusted for the "
        "client address ('*': every peer; repeatable); default: none, the peer's own address counts",
    )
    limits.add_argument(
        "--max-parse-tokens",
        type=int,
        default=131_072,
        metavar="N",
        help="most token ids POST /v1/harmony/parse reads; more are a 400 (default 131072)",
    )


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--model", default="openai/gpt-oss-20b", help="served model name")
    p.add_argument(
        "--engine",
        default="sglang",
        choices=["sglang", "vllm", "mlx", "trtllm", "tokenspeed"],
        help="gRPC protocol to speak",
    )
    p.add_argument(
        "--tokens-per-second", type=float, default=None, help="pace output (default: as fast as possible)"
    )
    p.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    p.add_argument("--output-tokens", type=int, default=None, help="pad answers to this many tokens")
    p.add_argument("--tokens-per-chunk", type=int, default=1, help="tokens per streamed message")
    p.add_argument("--mode", default="regular", choices=["regular", "prefill", "decode"], help="PD role")
    p.add_argument(
        "--bootstrap-port", type=int, default=8998, help="PD bootstrap port reported in server info"
    )
    p.add_argument(
        "--strip-stop-token", action="store_true", help="omit the final stop token from output ids"
    )
    p.add_argument("--non-harmony", action="store_true", help="serve a plain-text (non-Harmony) model")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harmony-gateway", description="OpenAI-compatible gateway for gpt-oss (Harmony) and other LLMs"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(
        sub.add_parser(
            "serve", help="run the gateway", description="Run the HTTP gateway in front of engine workers."
        )
    )
    add_sim_arguments(
        sub.add_parser(
            "sim-engine",
            aliases=["sim"],
            help="run the simulated gpt-oss engine",
            description="A real SGLang/vLLM gRPC server that answers in Harmony tokens without a GPU (docs/simulated-engine.md).",
        )
    )
    vocab = sub.add_parser(
        "vocab",
        help="write o200k_base.tiktoken for offline use",
        description="Write the o200k vocabulary from quicktok-v1 and check its sha256.",
    )
    vocab.add_argument("--out", default=None, help="folder to write into (default: the cache folder)")
    add_render_arguments(
        sub.add_parser(
            "render",
            help="show the exact Harmony prompt a request would send",
            description=(
                "Print what POST /v1/harmony/render returns for a saved request: the prompt with its "
                "special tokens, token ids, messages, stop ids, sampling and routing. FILE holds "
                '{"api": "chat"|"responses"|"messages", "request": {...}}, or a bare request body with '
                "--api. Rendered locally (no engine, no worker) unless --gateway names a running gateway."
            ),
        )
    )
    return parser


def add_render_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="the saved request (JSON); - reads standard input")
    p.add_argument(
        "--api",
        choices=["chat", "responses", "messages"],
        default=None,
        help="the API of a bare request body",
    )
    p.add_argument("--gateway", default=None, help="ask this running gateway (http://host:port) instead")
    p.add_argument(
        "--api-key", default=None, help="the key for --gateway (default: $HARMONY_GATEWAY_API_KEY)"
    )
    p.add_argument("--json", action="store_true", help="print the whole JSON answer")
    p.add_argument(
        "--conversation-start-date", default=None, help="the date in the system message (default: today, UTC)"
    )


DEMO_TEXT = """
Playground: http://{host}:{port}/   (open it in a browser)

harmony-gateway demo: gateway http://{host}:{port}/v1 -> simulated gpt-oss engine {sim}

  curl -s http://{host}:{port}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is 2+2?"}}]}}'

  python - <<'PY'
  from openai import OpenAI
  client = OpenAI(base_url="http://{host}:{port}/v1", api_key="unused")
  r = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print("reasoning:", r.choices[0].message.reasoning_content)
  print("answer:   ", r.choices[0].message.content)
  PY

  harmony-gateway render request.json   # the exact Harmony prompt a saved request would send

Press Ctrl+C to stop.
"""


async def _serve(settings: Settings, demo: bool) -> None:
    import uvicorn

    from .api.http_protocol import raise_open_file_limit, server_options
    from .app import create_app
    from .traffic.drain import DrainingServer

    sim = None
    if demo:
        from .sim import SimConfig, start_sim_engine

        sim = await start_sim_engine(SimConfig(host="127.0.0.1", port=0, tokens_per_second=200.0))
        settings = _with_workers(settings, (sim.url,))
    app = create_app(settings)
    raise_open_file_limit()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        log_config=None,
        **server_options(settings),
    )
    server = DrainingServer(config)
    if sim is not None:  # demo mode
        print(
            DEMO_TEXT.format(host=settings.host, port=settings.port, sim=sim.url, model="openai/gpt-oss-20b"),
            flush=True,
        )
    try:
        if settings.admin_port is None:
            await server.serve()
        else:
            await _serve_with_admin_listener(server, app, settings)
    finally:
        if sim is not None:
            await sim.stop()


async def _serve_with_admin_listener(server: Any, app: Any, settings: Settings) -> None:
    from .api.admin import admin_server

    assert settings.admin_port is not None
    admin = admin_server(app, settings.admin_host, settings.admin_port, settings.log_level)
    # The admin listener answers 503 until the main server's lifespan has built the app's state.
    admin_task = asyncio.create_task(admin.serve())
    try:
        await server.serve()
    finally:
        admin.should_exit = True
        await admin_task


def _with_workers(settings: Settings, urls: tuple[str, ...]) -> Settings:
    from dataclasses import replace

    return replace(settings, worker_urls=settings.worker_urls + urls)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from .observability.logging import configure_logging

    if args.command == "vocab":
        configure_logging("info")
        from .harmony.vocab import default_cache_dir, materialize_vocab

        path = materialize_vocab(Path(args.out) if args.out else default_cache_dir() / "vocab")
        print(f"wrote {path}; export TIKTOKEN_ENCODINGS_BASE={path.parent}")
        return
    if args.command in ("sim-engine", "sim"):
        configure_logging(args.log_level)
        from .sim import SimConfig, serve_forever

        config = SimConfig(
            host=args.host,
            port=args.port,
            model=args.model,
            harmony=not args.non_harmony,
            engine=args.engine,
            tokens_per_second=args.tokens_per_second,
            ttft_ms=args.ttft_ms,
            output_tokens=args.output_tokens,
            tokens_per_chunk=args.tokens_per_chunk,
            mode=args.mode,
            bootstrap_port=args.bootstrap_port,
            strip_stop_token=args.strip_stop_token,
        )
        _run(serve_forever(config))
        return
    if args.command == "render":
        configure_logging("warning")
        raise SystemExit(_render_command(args))
    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_json)
    warning = visible_secret_warning(args)
    if warning:
        log.warning(warning)
    problem = invalid_setting(settings)
    if problem:
        print(f"harmony-gateway: {problem}", file=sys.stderr)
        raise SystemExit(2)
    from .app import load_vocabularies
    from .harmony.encoding import VocabularyUnavailable

    try:
        load_vocabularies()  # fail fast, before binding the port
    except VocabularyUnavailable as exc:
        print(f"harmony-gateway: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if not settings.worker_urls and not settings.prefill_urls and not args.demo:
        print("harmony-gateway: no workers: pass --worker-url grpc://host:port (or --demo)", file=sys.stderr)
        raise SystemExit(2)
    if args.workers > 1:
        problem = _multiprocess_problem(settings, args.demo)
        if problem:
            print(f"harmony-gateway: --workers {args.workers}: {problem}", file=sys.stderr)
            raise SystemExit(2)
        _serve_processes(settings, list(sys.argv[1:] if argv is None else argv), args.workers)
        return
    _run(_serve(settings, args.demo))


def _render_command(args: argparse.Namespace) -> int:
    import json

    try:
        raw = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
        payload = json.loads(raw)
    except (OSError, ValueError) as exc:
        print(f"harmony-gateway render: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    if args.api is not None:
        payload = {"api": args.api, "request": payload}
    try:
        result = asyncio.run(_render(args, payload))
    except RenderFailed as exc:
        print(f"harmony-gateway render: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print(format_render(result))
    return 0


class RenderFailed(Exception):
    """The request could not be rendered; the message says why (the gateway's error message)."""


async def _render(args: argparse.Namespace, payload: Any) -> dict[str, Any]:
    from pydantic import ValidationError

    from .errors import GatewayError

    if args.gateway:
        import httpx

        key = args.api_key or os.environ.get("HARMONY_GATEWAY_API_KEY")
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                response = await client.post(
                    args.gateway.rstrip("/") + "/v1/harmony/render", json=payload, headers=headers
                )
        except httpx.HTTPError as exc:
            raise RenderFailed(f"cannot reach {args.gateway}: {exc}") from None
        body = (
            response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        )
        if response.status_code != 200:
            message = (body.get("error") or {}).get("message") or response.text
            raise RenderFailed(f"{response.status_code}: {message}")
        return body
    from .pipeline.inspect import render_offline

    settings = Settings(conversation_start_date=args.conversation_start_date, storage_url="memory://")
    try:
        return await render_offline(settings, payload)
    except (GatewayError, ValidationError, BaseExceptionGroup) as exc:
        raise RenderFailed(_render_error(exc)) from None


def _render_error(exc: BaseException) -> str:
    """One line for an offline rendering failure (the MCP pool's task group wraps errors in groups)."""
    from pydantic import ValidationError

    from .api.error_responses import validation_error_to_invalid
    from .errors import GatewayError

    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, ValidationError):
        exc = validation_error_to_invalid(exc)
    if isinstance(exc, GatewayError):
        where = f" ({exc.param})" if getattr(exc, "param", None) else ""
        return f"{exc.message}{where}"
    return f"{type(exc).__name__}: {exc}"


def format_render(result: dict[str, Any]) -> str:
    """The prompt as text, then its messages, stop ids, sampling and routing, for a terminal."""
    lines = [result.get("prompt_text", ""), ""]
    lines.append(f"{result['token_count']} tokens for {result['model']} ({result['api']})")
    for m in result.get("messages", []):
        head = m["role"] + (f" ({m['channel']})" if m.get("channel") else "")
        head += f" to={m['recipient']}" if m.get("recipient") else ""
        lines.append(f"  {m['token_count']:>6}  {head}")
    lines.append(f"token ids: {result['token_ids']}")
    lines.append(f"stop token ids: {result['stop_token_ids']}")
    sampling = {k: v for k, v in result["sampling"].items() if v is not None and v != [] and v is not False}
    lines.append(f"sampling: {sampling}")
    if result.get("constraint"):
        lines.append(f"constraint ({result['constraint']['type']}): {result['constraint']['value']}")
    routing = result.get("routing") or {}
    worker = routing.get("worker")
    choice = ""
    if "worker" in routing:  # only an admin's answer names the worker
        choice = " would pick " + (f"{worker['id']} ({worker['url']})" if worker else "no worker")
    lines.append(
        f"routing: {routing.get('policy')}{choice}"
        + (
            f", cached prefix {routing['cache_match_tokens']} tokens"
            if routing.get("cache_match_tokens")
            else ""
        )
    )
    lines.extend(f"note: {note}" for note in result.get("notes", []))
    return "\n".join(lines)


_ARGV_ENV = "HARMONY_GATEWAY_SERVE_ARGV"


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
    """uvicorn's supervisor: N spawned processes accept on one listening socket; each builds its app
    from the same command line (`app_from_env`)."""
    import json

    import uvicorn

    from .api.http_protocol import raise_open_file_limit, server_options

    os.environ[_ARGV_ENV] = json.dumps(argv)
    raise_open_file_limit()  # the spawned processes inherit it
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # /metrics must add up every process's counters, whichever process answers the scrape.
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="harmony-gateway-metrics-")
    if settings.max_concurrent_requests:
        # One admission cap for all processes: slots are byte-range locks on this file (traffic.admission).
        import tempfile

        from .app import SHARED_SLOTS_ENV

        os.environ[SHARED_SLOTS_ENV] = os.path.join(
            tempfile.mkdtemp(prefix="harmony-gateway-admission-"), "slots"
        )
    from .traffic.drain import use_draining_processes

    use_draining_processes()
    uvicorn.run(
        "harmony_gateway.cli:app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=workers,
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        log_config=None,
        **server_options(settings, processes=workers),
    )


def app_from_env() -> Any:
    """The app of one `serve --workers N` process, from the command line its supervisor was given."""
    import json

    from .api.http_protocol import configure_shared_protocol
    from .app import create_app
    from .observability.logging import configure_logging

    args = build_parser().parse_args(json.loads(os.environ[_ARGV_ENV]))
    if args.command == "render":
        configure_logging("warning")
        raise SystemExit(_render_command(args))
    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_json)
    configure_shared_protocol(settings)
    return create_app(settings)


if __name__ == "__main__":
    main()
