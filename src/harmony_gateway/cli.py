"""Command line: `harmony-gateway serve | sim-engine | vocab`. Every command has --help."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from .settings import Settings, Timeouts

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


def _stream_interval(value: str) -> int | None:
    if value == "engine":
        return None
    if value == "auto":
        return 0
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"--stream-interval expects a positive number, 'auto' or 'engine', got {value!r}")
    return int(value)


def _api_keys(args: argparse.Namespace) -> frozenset[str]:
    keys = set(args.api_key or ())
    if args.api_key_file:
        for line in Path(args.api_key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.add(line)
    env = os.environ.get("HARMONY_GATEWAY_API_KEYS")
    if env:
        keys.update(k.strip() for k in env.split(",") if k.strip())
    return frozenset(keys)


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
        max_retries=args.max_retries,
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
        api_keys=_api_keys(args),
        log_level=args.log_level,
        log_json=args.log_json,
        log_prompts=args.log_prompts,
        mcp_config=args.mcp_config,
        mcp_allow_hosts=tuple(_split_list(args.mcp_allow_hosts)),
        mcp_tool_timeout=args.mcp_tool_timeout,
        mcp_max_output_chars=args.mcp_max_output_chars,
        max_tool_calls=args.max_tool_calls,
        tokenizer_paths=_pairs(args.tokenizer, "--tokenizer"),
        reasoning_parsers=_pairs(args.reasoning_parser, "--reasoning-parser"),
        tool_call_parsers=_pairs(args.tool_call_parser, "--tool-call-parser"),
        model_aliases=_pairs(args.model_alias, "--model-alias"),
        text_parsers=_pairs(args.text_parser, "--text-parser"),
        text_parser_window_chars=args.text_parser_window_chars,
        text_parser_window_seconds=args.text_parser_window_seconds,
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
        "--engine", default="auto", choices=["auto", "sglang", "vllm"], help="engine gRPC protocol"
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
        "--api-key",
        action="append",
        metavar="KEY",
        help="require this bearer key on /v1 routes (repeatable; also HARMONY_GATEWAY_API_KEYS)",
    )
    p.add_argument("--api-key-file", default=None, help="file with one API key per line")
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


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--model", default="openai/gpt-oss-20b", help="served model name")
    p.add_argument("--engine", default="sglang", choices=["sglang", "vllm"], help="gRPC protocol to speak")
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
    return parser


DEMO_TEXT = """
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

Press Ctrl+C to stop.
"""


async def _serve(settings: Settings, demo: bool) -> None:
    import uvicorn

    from .app import create_app

    sim = None
    if demo:
        from .sim import SimConfig, start_sim_engine

        sim = await start_sim_engine(SimConfig(host="127.0.0.1", port=0, tokens_per_second=200.0))
        settings = _with_workers(settings, (sim.url,))
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        log_config=None,
    )
    server = uvicorn.Server(config)
    if sim is not None:  # demo mode
        print(
            DEMO_TEXT.format(host=settings.host, port=settings.port, sim=sim.url, model="openai/gpt-oss-20b"),
            flush=True,
        )
    try:
        await server.serve()
    finally:
        if sim is not None:
            await sim.stop()


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
    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_json)
    problem = invalid_setting(settings)
    if problem:
        print(f"harmony-gateway: {problem}", file=sys.stderr)
        raise SystemExit(2)
    from .harmony.encoding import VocabularyUnavailable, get_encoding

    try:
        get_encoding()  # fail fast, before binding the port
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


_ARGV_ENV = "HARMONY_GATEWAY_SERVE_ARGV"


def _multiprocess_problem(settings: Settings, demo: bool) -> str | None:
    if demo:
        return "--demo runs in one process"
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

    os.environ[_ARGV_ENV] = json.dumps(argv)
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # /metrics must add up every process's counters, whichever process answers the scrape.
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="harmony-gateway-metrics-")
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
    )


def app_from_env() -> Any:
    """The app of one `serve --workers N` process, from the command line its supervisor was given."""
    import json

    from .app import create_app
    from .observability.logging import configure_logging

    args = build_parser().parse_args(json.loads(os.environ[_ARGV_ENV]))
    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_json)
    return create_app(settings)


if __name__ == "__main__":
    main()
