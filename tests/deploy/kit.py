"""What the deployment kit's tests share: the repository's files, the `serve` options, a configuration
file turned into the command line it stands for, and the tools that are skipped locally and required
under CI when missing (`make test` installs them through the test extra)."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from harmony_gateway.cli import serve

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
KUBERNETES = ROOT / "deploy" / "kubernetes"


def require(tool: str) -> str:
    """The path of a command-line tool the test extra installs; skip locally, fail under CI, without it."""
    found = shutil.which(tool) or shutil.which(tool, path=str(Path(sys.executable).parent))
    if found:
        return found
    message = f"{tool} is not installed: `make test` installs it (the test extra)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def require_module(name: str) -> ModuleType:
    """A module the test extra installs; skip locally, fail under CI, without it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        message = f"{name} is not installed: `make test` installs it (the test extra)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harmony-gateway serve")
    serve.add_arguments(parser)
    return parser


def serve_options() -> dict[str, argparse.Action]:
    """`serve`'s options by name, without the dashes (`worker-dns`)."""
    return {
        flag[2:]: action
        for action in serve_parser()._actions
        for flag in action.option_strings
        if flag.startswith("--")
    }
