"""`harmony-gateway sim-engine` (alias `sim`): the simulated gpt-oss engine as a real gRPC server, for
local development without a GPU and as the cluster twin of routing benchmarks (docs/simulated-engine.md)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..observability.logging import configure_logging
from .common import ENGINE_PROTOCOLS, run_until_interrupted

if TYPE_CHECKING:
    from ..sim import SimConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051, help="port to listen on")
    p.add_argument("--model", default="openai/gpt-oss-20b", help="served model name")
    p.add_argument(
        "--engine",
        default="sglang",
        choices=ENGINE_PROTOCOLS,
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
    p.add_argument(
        "--no-record-requests",
        action="store_true",
        help="keep no record of received requests (long benchmarks)",
    )
    p.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="log verbosity"
    )
    twin = p.add_argument_group(
        "cluster twin",
        "The KV cache, scheduler and KV-event stream a routing benchmark runs on (timing all 0: the "
        "pacing options above alone).",
    )
    twin.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    twin.add_argument(
        "--kv-capacity-tokens", type=int, default=1_000_000, help="KV cache capacity (whole blocks)"
    )
    twin.add_argument(
        "--prefill-ms-per-token", type=float, default=0.0, help="prefill cost per uncached prompt token"
    )
    twin.add_argument(
        "--decode-ms-per-token", type=float, default=0.0, help="decode step cost per token, alone"
    )
    twin.add_argument(
        "--decode-ms-per-running",
        type=float,
        default=0.0,
        help="added to each decode step's cost per decoding request",
    )
    twin.add_argument(
        "--max-running-requests", type=int, default=1024, help="admission window; the rest wait FIFO"
    )
    twin.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve SubscribeKvEvents (not on MLX)",
    )
    twin.add_argument(
        "--kv-history-batches", type=int, default=10_000, help="KV-event batches kept to resume from"
    )
    twin.add_argument(
        "--kv-heartbeat-s", type=float, default=1.0, help="load-only heartbeat after this much silence"
    )
    twin.add_argument(
        "--kv-heartbeat-backoff-s",
        type=float,
        default=5.0,
        help="heartbeat interval once two in a row were unchanged",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The `SimConfig` the flags describe; exits with one line when they cannot work."""
    # lazy: the simulator (gRPC servers, scripts) loads only for this command, not in every gateway
    from ..sim import SimConfig

    try:
        return SimConfig(
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
            record_requests=not args.no_record_requests,
            block_size=args.block_size,
            kv_capacity_tokens=args.kv_capacity_tokens,
            prefill_ms_per_token=args.prefill_ms_per_token,
            decode_ms_per_token=args.decode_ms_per_token,
            decode_ms_per_running=args.decode_ms_per_running,
            max_running_requests=args.max_running_requests,
            kv_events=args.kv_events,
            kv_history_batches=args.kv_history_batches,
            kv_heartbeat_s=args.kv_heartbeat_s,
            kv_heartbeat_backoff_s=args.kv_heartbeat_backoff_s,
        )
    except ValueError as exc:
        raise SystemExit(f"sim-engine: {exc}") from None


def run(args: argparse.Namespace) -> None:
    """Serve the simulated engine until Ctrl+C."""
    configure_logging(args.log_level)
    # lazy: the simulator (gRPC servers, scripts) loads only for this command, not in every gateway
    from ..sim import serve_forever

    run_until_interrupted(serve_forever(config_from_args(args)))
