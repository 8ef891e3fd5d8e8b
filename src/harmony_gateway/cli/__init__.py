"""Command line: `harmony-gateway serve | sim-engine | vocab | render`, one module per command, and
`--version`. Every command has --help; serve's shows its options in groups, with their defaults, and
takes each of them from the environment or a config file too (cli/config.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING

from .. import __version__
from ..observability.logging import configure_logging
from . import render, serve, sim_engine, vocab
from .checks import StartupError
from .common import DefaultsHelpFormatter
from .config import CommandParser
from .serve import SERVE_ARGV_ENV, invalid_setting, settings_from_args, visible_secret_warning

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = [
    "StartupError",
    "app_from_env",
    "build_parser",
    "gateway_version",
    "invalid_setting",
    "main",
    "settings_from_args",
    "visible_secret_warning",
]


def gateway_version() -> str:
    """The installed distribution's version, else the package's own (running from a source tree)."""
    try:
        return metadata.version("harmony-gateway")
    except metadata.PackageNotFoundError:
        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harmony-gateway", description="OpenAI-compatible gateway for gpt-oss (Harmony) and other LLMs"
    )
    parser.add_argument("--version", action="version", version=f"harmony-gateway {gateway_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    serve_parser = sub.add_parser(
        "serve", help="run the gateway", description=serve.DESCRIPTION, formatter_class=DefaultsHelpFormatter
    )
    serve_parser.layered = True  # also from HARMONY_GATEWAY_<OPTION> and --config FILE
    serve.add_arguments(serve_parser)
    sim_engine.add_arguments(
        sub.add_parser(
            "sim-engine",
            aliases=["sim"],
            help="run the simulated gpt-oss engine",
            description="A real SGLang/vLLM gRPC server that answers in Harmony tokens without a GPU (docs/simulated-engine.md).",
            formatter_class=DefaultsHelpFormatter,
        )
    )
    vocab.add_arguments(
        sub.add_parser(
            "vocab",
            help="write o200k_base.tiktoken for offline use",
            description="Write the o200k vocabulary from quicktok-v1 and check its sha256.",
            formatter_class=DefaultsHelpFormatter,
        )
    )
    render.add_arguments(
        sub.add_parser(
            "render",
            help="show the exact Harmony prompt a request would send",
            description=(
                "Print what POST /v1/harmony/render returns for a saved request: the prompt with its "
                "special tokens, token ids, messages, stop ids, sampling and routing. FILE holds "
                '{"api": "chat"|"responses"|"messages", "request": {...}}, or a bare request body with '
                "--api. Rendered locally (no engine, no worker) unless --gateway names a running gateway."
            ),
            formatter_class=DefaultsHelpFormatter,
        )
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "vocab":
        vocab.run(args)
    elif args.command in ("sim-engine", "sim"):
        sim_engine.run(args)
    elif args.command == "render":
        raise SystemExit(render.run(args))
    else:
        serve.run(args, list(sys.argv[1:] if argv is None else argv))


def app_from_env() -> FastAPI:
    """The app of one `serve --workers N` process, from the command line its supervisor was given
    (`SERVE_ARGV_ENV`); uvicorn's supervisor calls it in every process it spawns."""
    # The serving stack loads only in serving processes, so --help and the other commands start fast.
    from ..api.http_protocol import configure_shared_protocol  # lazy: serving stack (uvicorn)
    from ..app import create_app  # lazy: serving stack (FastAPI, pipeline, storage)

    args = build_parser().parse_args(json.loads(os.environ[SERVE_ARGV_ENV]))
    if args.command == "render":
        raise SystemExit(render.run(args))
    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_json)
    configure_shared_protocol(settings)
    return create_app(settings)
