"""Reasoning and tool-call parsers of non-Harmony models, and their chain."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harmony_gateway.errors import InvalidRequest
from harmony_gateway.harmony.text_events import (
    ContentDelta,
    ReasoningDelta,
    Terminated,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from harmony_gateway.pipeline.output_parsers import (
    JsonToolCallParser,
    build_parser_chain,
    validate_parser_names,
)

OUTPUT = (
    "<think>Need weather.</think>Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>'
)


def _summary(events: list) -> tuple[str, str, list[tuple[str, str]], int]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            names[e.index] = e.name
        elif isinstance(e, ToolCallArgumentsDelta):
            args[e.index] = args.get(e.index, "") + e.text
    ends = sum(isinstance(e, ToolCallEnd) for e in events)
    return reasoning, content, [(names[i], args.get(i, "")) for i in sorted(names)], ends


def _feed(chunks: list[str]) -> list:
    chain = build_parser_chain(text_kind=None, reasoning="think", tool_call="json")
    assert chain is not None
    events = [e for c in chunks for e in chain.feed(c)]
    return events + chain.finish()


def test_think_then_tool_calls() -> None:
    events = _feed([OUTPUT])
    assert events[-1] == Terminated("eos")
    reasoning, content, calls, ends = _summary(events)
    assert reasoning == "Need weather."
    assert content == "Let me check.\n"
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]
    assert ends == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(OUTPUT)), max_size=20))
def test_any_chunking_gives_the_same_result(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    chunks = [OUTPUT[a:b] for a, b in zip([0, *points], [*points, len(OUTPUT)], strict=True)]
    assert _summary(_feed(chunks)) == _summary(_feed([OUTPUT]))


def test_a_block_that_is_not_a_call_stays_content() -> None:
    parser = JsonToolCallParser()
    events = parser.feed("a <tool_call>not json</tool_call> b") + parser.finish()
    assert _summary(events)[1] == "a <tool_call>not json</tool_call> b"
    assert parser.stats.parse_errors == 1


def test_an_unclosed_complete_call_is_still_a_call() -> None:
    parser = JsonToolCallParser()
    events = parser.feed('<tool_call>{"name": "f", "arguments": {}}') + parser.finish()
    assert _summary(events)[2] == [("f", "{}")]


def test_a_lone_angle_bracket_is_released() -> None:
    parser = JsonToolCallParser()
    assert parser.feed("x <") == [ContentDelta("x ")]
    assert parser.feed("y") == [ContentDelta("<y")]


def test_unknown_names_are_rejected() -> None:
    with pytest.raises(InvalidRequest, match="reasoning parser"):
        validate_parser_names({"m": "nope"}, {}, {})
    with pytest.raises(InvalidRequest, match="text parser"):
        validate_parser_names({}, {}, {"m": "nope"})
    assert build_parser_chain(text_kind="off", reasoning="think", tool_call="json") is None
    assert build_parser_chain(text_kind=None, reasoning=None, tool_call=None) is None
