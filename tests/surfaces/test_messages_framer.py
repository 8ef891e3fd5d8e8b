"""Anthropic Messages framed as data: a plan (`plan_messages`) answered with real Harmony token ids as
engine chunks, its stream events or Message body read back as JSON."""

from __future__ import annotations

from typing import Any

from harmony_gateway.errors import UpstreamUnavailable
from harmony_gateway.pipeline.context import RequestContext
from harmony_gateway.surfaces.messages.run import plan_messages
from harmony_gateway.surfaces.messages.types import MessagesRequest
from tests.harmony.test_render import WEATHER_PARAMS
from tests.surfaces._support import (
    ANSWER,
    MODEL,
    PROMPT_TOKENS,
    REQUEST_ID,
    WEATHER_CALL,
    Event,
    answered,
    anthropic_context,
    engine_chunks,
    harmony_ids,
    serving_state,
)

THINKING = {"type": "enabled", "budget_tokens": 2048}
WEATHER = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_PARAMS}


async def run_messages(
    items: list[Any], fail: BaseException | None = None, **body: Any
) -> tuple[Any, RequestContext]:
    ctx = anthropic_context()
    request = MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 256, "messages": [{"role": "user", "content": "Weather?"}], **body}
    )
    planned = await plan_messages(serving_state(), request, ctx)
    return await answered(ctx, planned, items, fail), ctx


def checked(events: list[Event]) -> list[Event]:
    """The events, after checking that each names its own type (Anthropic's SDK dispatches on both)."""
    assert all(data["type"] == name for name, data in events)
    return events


def block_deltas(events: list[Event], index: int, kind: str) -> list[dict[str, Any]]:
    return [
        data["delta"]
        for name, data in events
        if name == "content_block_delta" and data["index"] == index and data["delta"]["type"] == kind
    ]


async def test_a_stream_is_thinking_then_text_then_the_stop_reason() -> None:
    events, ctx = await run_messages(engine_chunks(ANSWER), stream=True, thinking=THINKING)
    assert [name for name, _ in checked(events)] == [
        "message_start",
        "ping",
        "content_block_start",  # thinking
        "content_block_delta",
        "content_block_delta",  # its signature
        "content_block_stop",
        "content_block_start",  # text
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    message = events[0][1]["message"]
    assert (message["id"], message["role"], message["model"], message["content"]) == (
        f"msg_{REQUEST_ID}",
        "assistant",
        MODEL,
        [],
    )
    assert message["usage"]["input_tokens"] == PROMPT_TOKENS
    starts = [
        (data["index"], data["content_block"]) for name, data in events if name == "content_block_start"
    ]
    assert starts == [
        (0, {"type": "thinking", "thinking": "", "signature": ""}),
        (1, {"type": "text", "text": ""}),
    ]
    assert block_deltas(events, 0, "thinking_delta") == [{"type": "thinking_delta", "thinking": "think"}]
    (signature,) = block_deltas(events, 0, "signature_delta")
    assert signature["signature"]
    assert block_deltas(events, 1, "text_delta") == [{"type": "text_delta", "text": "Hello"}]
    stops = [data["index"] for name, data in events if name == "content_block_stop"]
    assert stops == [0, 1]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(harmony_ids(ANSWER)) == ctx.completion_tokens


async def test_a_tool_call_is_a_tool_use_block_and_the_tool_use_stop_reason() -> None:
    events, _ = await run_messages(
        engine_chunks(WEATHER_CALL), stream=True, thinking=THINKING, tools=[WEATHER]
    )
    checked(events)
    starts = [
        (data["index"], data["content_block"]) for name, data in events if name == "content_block_start"
    ]
    assert [(index, block["type"]) for index, block in starts] == [(0, "thinking"), (1, "tool_use")]
    tool_use = starts[1][1]
    assert tool_use["id"].startswith("toolu_")
    assert (tool_use["name"], tool_use["input"]) == ("get_weather", {})
    thinking = "".join(d["thinking"] for d in block_deltas(events, 0, "thinking_delta"))
    assert thinking == "need weather"
    assert block_deltas(events, 1, "input_json_delta") == [
        {"type": "input_json_delta", "partial_json": '{"city":"Paris"}'}
    ]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert events[-1] == ("message_stop", {"type": "message_stop"})


async def test_thinking_not_asked_for_is_not_shown() -> None:
    events, _ = await run_messages(engine_chunks(ANSWER), stream=True)
    blocks = [
        data["content_block"]["type"] for name, data in checked(events) if name == "content_block_start"
    ]
    assert blocks == ["text"]


async def test_a_failure_mid_stream_ends_with_anthropics_error_event() -> None:
    chunks = engine_chunks(ANSWER)
    events, ctx = await run_messages(chunks[:1], UpstreamUnavailable("the engine went away"), stream=True)
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "overloaded_error", "message": "the engine went away"}},
    )
    assert "message_stop" not in [name for name, _ in events]
    assert ctx.status == 503


async def test_the_json_body_has_signed_thinking_and_text() -> None:
    body, ctx = await run_messages(engine_chunks(ANSWER), thinking=THINKING)
    assert (body["id"], body["type"], body["role"], body["model"]) == (
        f"msg_{REQUEST_ID}",
        "message",
        "assistant",
        MODEL,
    )
    thinking, text = body["content"]
    assert (thinking["type"], thinking["thinking"]) == ("thinking", "think")
    assert thinking["signature"]
    assert text == {"type": "text", "text": "Hello"}
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)
    assert body["usage"]["output_tokens"] == len(harmony_ids(ANSWER)) == ctx.completion_tokens


async def test_the_json_body_of_a_tool_call() -> None:
    body, _ = await run_messages(engine_chunks(WEATHER_CALL), tools=[WEATHER])
    (tool_use,) = body["content"]
    assert tool_use["type"] == "tool_use" and tool_use["id"].startswith("toolu_")
    assert (tool_use["name"], tool_use["input"]) == ("get_weather", {"city": "Paris"})
    assert body["stop_reason"] == "tool_use"
