"""Output parsers by the names used on the command line: one line per parser.

`--reasoning-parser MODEL=NAME` picks from `REASONING_PARSERS`, `--tool-call-parser MODEL=NAME` from
`TOOL_CALL_PARSERS`, `--text-parser MODEL=KIND` (text-mode upstreams) from `TEXT_PARSER_KINDS`.
`build_parser_chain` turns a model's choices into the `ParserChain` of one choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from ...errors import InvalidRequest
from ...harmony.text_parser import ParserStats, TextOutputParser, create_text_parser
from .base import ParserChain
from .json_tool_call import JsonToolCallParser
from .think import think_implicit_parser, think_parser

ParserFactory = Callable[[ParserStats], TextOutputParser]

REASONING_PARSERS: Final[dict[str, ParserFactory]] = {
    "think": think_parser,
    "qwen3": think_parser,
    "think_implicit": think_implicit_parser,
    "deepseek_r1": think_implicit_parser,
}

TOOL_CALL_PARSERS: Final[dict[str, ParserFactory]] = {
    "json": lambda stats: JsonToolCallParser(stats=stats),
    "hermes": lambda stats: JsonToolCallParser(stats=stats),
}

#: `off` skips parsing entirely (the raw text is the answer); the others are `create_text_parser` kinds.
TEXT_PARSER_KINDS: Final = ("harmony", "think", "marker", "passthrough", "off")


def _lookup(table: dict[str, ParserFactory], name: str, flag: str) -> ParserFactory:
    factory = table.get(name)
    if factory is None:
        raise InvalidRequest(f"unknown {flag} {name!r}; expected one of {', '.join(sorted(table))}")
    return factory


def validate_parser_names(reasoning: dict[str, str], tool_call: dict[str, str], text: dict[str, str]) -> None:
    """Raise InvalidRequest naming the first unknown parser (the CLI calls this before serving)."""
    for name in reasoning.values():
        _lookup(REASONING_PARSERS, name, "reasoning parser")
    for name in tool_call.values():
        _lookup(TOOL_CALL_PARSERS, name, "tool-call parser")
    for kind in text.values():
        if kind not in TEXT_PARSER_KINDS:
            raise InvalidRequest(
                f"unknown text parser {kind!r}; expected one of {', '.join(TEXT_PARSER_KINDS)}"
            )


def build_parser_chain(
    *,
    text_kind: str | None,
    reasoning: str | None,
    tool_call: str | None,
    harmony_options: dict[str, Any] | None = None,
) -> ParserChain | None:
    """The chain for one choice, or None when the output is used as it comes (`text_kind="off"`, or
    no parser configured). A text kind replaces the reasoning parser; `harmony` finds tool calls
    itself, so no tool-call parser follows it. `harmony_options` are keyword options of the Harmony
    text parser (`marker_window_chars`, `marker_window_seconds`)."""
    if text_kind == "off":
        return None
    stats = ParserStats()
    first: TextOutputParser | None = None
    if text_kind is not None:
        if text_kind not in TEXT_PARSER_KINDS:
            raise InvalidRequest(f"unknown text parser {text_kind!r}")
        if text_kind == "harmony":
            first = create_text_parser(text_kind, stats=stats, **(harmony_options or {}))
            tool_call = None
        else:
            first = create_text_parser(text_kind, stats=stats)
    elif reasoning:
        first = _lookup(REASONING_PARSERS, reasoning, "reasoning parser")(stats)
    then = _lookup(TOOL_CALL_PARSERS, tool_call, "tool-call parser")(stats) if tool_call else None
    if first is None and then is None:
        return None
    return ParserChain(first, then, stats)


__all__ = [
    "REASONING_PARSERS",
    "TEXT_PARSER_KINDS",
    "TOOL_CALL_PARSERS",
    "build_parser_chain",
    "validate_parser_names",
]
