"""Events produced by the text-level output parsers in `text_parser.py`.

Upstreams that return gpt-oss (or think-tag, or marker) output as decoded text are parsed into these
events; the pipeline turns them into Chat/Responses deltas. They are deliberately separate from the
token-level `HarmonyEvent` types: crossing from "text we had to guess at" to "tokens we classified"
shows up as a change of name.

A stream of events always ends with exactly one `Terminated`. Tool calls appear as
`ToolCallStart(i)`, zero or more `ToolCallArgumentsDelta(i)`, then `ToolCallEnd(i)`, with `i` counting
0, 1, ... per parser; deltas are never empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TerminationReason = Literal["return", "call", "eos"]


@dataclass(frozen=True, slots=True)
class _TextDelta:
    """A non-empty piece of output text; the subclass says which part of the output it belongs to."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta(_TextDelta):
    """Chain-of-thought text (Harmony `analysis`, text inside `<think>`, text before a marker)."""


@dataclass(frozen=True, slots=True)
class ContentDelta(_TextDelta):
    """Answer text (Harmony `final`, recipient-less `commentary` preambles, anything unclassifiable)."""


@dataclass(frozen=True, slots=True)
class _ToolCallEvent:
    """An event of tool call `index` (counted 0, 1, ... per parser)."""

    index: int


@dataclass(frozen=True, slots=True)
class ToolCallStart(_ToolCallEvent):
    """A tool call opens. `name` is the recipient without a `functions.` prefix; `id` is left to the
    gateway unless the upstream supplied one."""

    name: str
    id: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCallArgumentsDelta(_ToolCallEvent):
    """A piece of the raw argument text of call `index`, passed on unvalidated."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd(_ToolCallEvent):
    """Call `index` is complete; no more argument deltas follow for it."""


@dataclass(frozen=True, slots=True)
class Terminated:
    """The output ended: `return` / `call` are Harmony stop markers seen in the text, `eos` means the
    stream simply ended (stop tokens stripped by the upstream, or a non-Harmony model)."""

    reason: TerminationReason


TextEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd | Terminated
