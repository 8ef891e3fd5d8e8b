"""Reasoning parser for `<think>...</think>` models (Qwen3, DeepSeek-R1, QwQ): the text-level
`ThinkTagParser`, configured. `think` expects the model to open the block itself; `think_implicit`
is for chat templates that end the prompt with `<think>` (DeepSeek-R1), so output starts as reasoning."""

from __future__ import annotations

from ...harmony.text_parser import ParserStats, TextOutputParser, ThinkTagParser


def think_parser(stats: ParserStats) -> TextOutputParser:
    return ThinkTagParser(stats=stats)


def think_implicit_parser(stats: ParserStats) -> TextOutputParser:
    return ThinkTagParser(think_implicit_start=True, stats=stats)


__all__ = ["think_implicit_parser", "think_parser"]
