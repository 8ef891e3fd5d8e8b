"""`harmony-gateway sim-engine` (alias `sim`): the simulated gpt-oss engine as a real gRPC server, for
local development without a GPU (docs/simulated-engine.md)."""

from __future__ import annotations

import argparse

from ..observability.logging import configure_logging
from .common import ENGINE_PROTOCOLS, run_until_interrupted


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
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="log verbosity"
    )


def run(args: argparse.Namespace) -> None:
    """Serve the simulated engine until Ctrl+C."""
    configure_logging(args.log_level)
    # lazy: the simulator (gRPC servers, scripts) loads only for this command, not in every gateway
    from ..sim import SimConfig, serve_forever

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
    run_until_interrupted(serve_forever(config))
