"""`harmony-gateway vocab`: writes o200k_base.tiktoken for offline use and checks its sha256."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..harmony.vocab import default_cache_dir, materialize_vocab
from ..observability.logging import configure_logging


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="folder to write into (default: the cache folder)")


def run(args: argparse.Namespace) -> None:
    configure_logging("info")
    path = materialize_vocab(Path(args.out) if args.out else default_cache_dir() / "vocab")
    print(f"wrote {path}; export TIKTOKEN_ENCODINGS_BASE={path.parent}")
