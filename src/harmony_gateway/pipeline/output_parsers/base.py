"""The one interface every output parser implements, and the chain that composes them per model.

An output parser is a `harmony.text_parser.TextOutputParser`: `feed(text)` returns the `TextEvent`s the
text completes, `finish()` flushes and ends with one `Terminated`; neither raises on any text, and each
keeps its counters in a `ParserStats`. A model's output runs through at most two of them in order
(`ParserChain`): a reasoning parser (reasoning vs answer text, e.g. `<think>` tags; or the text-level
Harmony parser, which also finds tool calls), then a tool-call parser applied to the answer text only.
"""

from __future__ import annotations

from ...harmony.text_events import ContentDelta, Terminated, TextEvent
from ...harmony.text_parser import ParserStats, TextOutputParser


class ParserChain:
    """`first`'s answer text is fed to `then`; everything else passes through in order. Either may be
    None. One `Terminated` ends the output (the first parser's reason)."""

    __slots__ = ("first", "stats", "then")

    def __init__(
        self, first: TextOutputParser | None, then: TextOutputParser | None, stats: ParserStats
    ) -> None:
        self.first = first
        self.then = then
        self.stats = stats

    def _pipe(self, events: list[TextEvent]) -> list[TextEvent]:
        then = self.then
        if then is None:
            return events
        out: list[TextEvent] = []
        for event in events:
            if type(event) is ContentDelta:
                out.extend(then.feed(event.text))
            elif type(event) is not Terminated:
                out.append(event)
        return out

    def feed(self, text: str) -> list[TextEvent]:
        if not text:
            return []
        if self.first is None:
            return self.then.feed(text) if self.then is not None else [ContentDelta(text)]
        return self._pipe(self.first.feed(text))

    def finish(self) -> list[TextEvent]:
        reason: Terminated = Terminated("eos")
        if self.first is None:
            out: list[TextEvent] = []
        else:
            tail = self.first.finish()
            reason = next((e for e in tail if type(e) is Terminated), reason)
            out = (
                self._pipe(tail) if self.then is not None else [e for e in tail if type(e) is not Terminated]
            )
        if self.then is not None:
            out.extend(e for e in self.then.finish() if type(e) is not Terminated)
        out.append(reason)
        return out


__all__ = ["ParserChain"]
