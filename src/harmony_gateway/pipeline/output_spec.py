"""How a non-Harmony model's (or an HTTP upstream's) text output is parsed, per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import Settings
from .output_parsers import ParserChain, build_parser_chain
from .tokenizer import ModelTokenizer


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """How a model's text output is parsed; `PreparedRequest.output_adapter` holds one per request.

    `tokenizer` is set for token-id engines and None for text-mode upstreams. `text_kind` is a `--text-parser` kind (it replaces the reasoning parser).
    """

    tokenizer: ModelTokenizer | None = None
    text_kind: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    no_stop_trim: bool = False
    #: The Harmony text parser's fallback window (`--text-parser-window-chars` / `-seconds`).
    window_chars: int = 256
    window_seconds: float | None = None

    @classmethod
    def configured(cls, settings: Settings, **fields: Any) -> OutputSpec:
        """A spec carrying the operator's text-parser window settings."""
        return cls(
            window_chars=settings.text_parser_window_chars,
            window_seconds=settings.text_parser_window_seconds,
            **fields,
        )

    def new_chain(self) -> ParserChain | None:
        return build_parser_chain(
            text_kind=self.text_kind,
            reasoning=self.reasoning_parser,
            tool_call=self.tool_call_parser,
            harmony_options={
                "marker_window_chars": self.window_chars,
                "marker_window_seconds": self.window_seconds,
            },
        )


__all__ = ["OutputSpec"]
