"""What the commands share: argument types, the help formatter that shows defaults, and the event-loop
runner that commands serving until Ctrl+C use."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Coroutine, Sequence
from contextlib import suppress
from typing import Any

from ..engines.registry import GRPC_ENGINES

#: The engine gRPC protocols, from the engines registry (its `auto` entry detects one of them):
#: `serve --engine` takes these or `auto`, and `sim-engine --engine` speaks one of them.
ENGINE_PROTOCOLS: tuple[str, ...] = tuple(name for name in GRPC_ENGINES if name != "auto")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends `(default: VALUE)` to every option with a value of its own.

    An option whose help already places `%(default)s` is left alone, and so are the unset defaults
    (None, and False for a switch): their help says what leaving them out means, if anything.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help
        if help_text is None or "%(default)" in help_text:
            return help_text
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return help_text
        return help_text + " (default: %(default)s)"


def run_until_interrupted(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` on uvloop when it is installed (else asyncio's own loop); Ctrl+C ends it quietly."""
    try:
        import uvloop  # lazy: optional (uvicorn[standard] installs it only where it builds)

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner, suppress(KeyboardInterrupt):
        runner.run(coro)


def split_list(values: Sequence[str] | None) -> list[str]:
    """The items of repeated comma-separated flags (`--x a,b --x c`), blanks dropped."""
    out: list[str] = []
    for value in values or ():
        out.extend(v.strip() for v in value.split(",") if v.strip())
    return out


def pairs(values: Sequence[str] | None, flag: str) -> dict[str, str]:
    """`MODEL=VALUE` flags as a dict; raises ValueError naming `flag` for an entry without `=`."""
    out: dict[str, str] = {}
    for value in values or ():
        if "=" not in value:
            raise ValueError(f"{flag} {value}: expects MODEL=VALUE")
        key, val = value.split("=", 1)
        out[key.strip()] = val.strip()
    return out


def positive_int(value: str) -> int:
    """Argument type: a whole number of 1 or more."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return number
