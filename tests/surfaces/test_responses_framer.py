"""The Responses API framed as data: a response planned as `plan_responses` plans it, its generation
opened with real Harmony token ids as engine chunks, its stream events or Response body read back as
JSON. Streams also pass the pairing/stack validator (tests/support/responses_stream.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from unittest import mock

from harmony_gateway.errors import UpstreamTimeout
from harmony_gateway.pipeline.context import RequestContext
from harmony_gateway.pipeline.drive import answer
from harmony_gateway.surfaces.responses.service import service
from harmony_gateway.surfaces.responses.types import ResponsesRequest
from tests.harmony.test_render import WEATHER_PARAMS
from tests.support.responses_stream import validate_event_stream
from tests.surfaces._support import (
    ANSWER,
    MODEL,
    PROMPT_TOKENS,
    WEATHER_CALL,
    engine_chunks,
    harmony_ids,
    openai_context,
    serving_state,
    source,
    sse_events,
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather",
    "parameters": WEATHER_PARAMS,
}


async def run_response(
    items: list[Any], fail: BaseException | None = None, **body: Any
) -> tuple[Any, RequestContext]:
    """A response planned by `service.plan_responses` itself, its first generation opened on `items`
    (then `fail`) instead of dispatched to an engine."""
    ctx = openai_context("responses")
    request = ResponsesRequest.model_validate({"model": MODEL, "input": "Weather in Paris?", **body})

    async def opened(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        return source(items, fail)

    with mock.patch.object(service, "open_generation", opened):
        result = await answer(ctx, await service.plan_responses(serving_state(), request, ctx))
    if isinstance(result, dict):
        return result, ctx
    events = sse_events(b"".join([piece async for piece in result]))
    assert all(name == data["type"] for name, data in events)
    return [data for _, data in events], ctx


def types(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in events]


ITEM_EVENTS = {
    "reasoning": [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ],
    "message": [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ],
}


async def test_a_stream_is_created_reasoning_message_completed_in_sequence() -> None:
    events, ctx = await run_response(engine_chunks(ANSWER), stream=True)
    validate_event_stream(events)
    assert types(events) == [
        "response.created",
        "response.in_progress",
        *ITEM_EVENTS["reasoning"],
        *ITEM_EVENTS["message"],
        "response.completed",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    deltas = [(e["type"], e["output_index"], e["delta"]) for e in events if e["type"].endswith(".delta")]
    assert deltas == [
        ("response.reasoning_text.delta", 0, "think"),
        ("response.output_text.delta", 1, "Hello"),
    ]
    response = events[-1]["response"]
    assert response["status"] == "completed"
    reasoning, message = response["output"]
    assert (reasoning["type"], reasoning["content"]) == (
        "reasoning",
        [{"type": "reasoning_text", "text": "think"}],
    )
    assert (message["type"], message["role"], message["status"]) == ("message", "assistant", "completed")
    assert [(part["type"], part["text"]) for part in message["content"]] == [("output_text", "Hello")]
    assert response["usage"]["input_tokens"] == PROMPT_TOKENS
    assert response["usage"]["output_tokens"] == len(harmony_ids(ANSWER)) == ctx.completion_tokens
    stored = await serving_state().store.get_response(response["id"], ctx.owner)
    assert stored is not None and stored.status == "completed"  # stored before the client heard


async def test_a_function_call_is_a_function_call_item() -> None:
    events, _ = await run_response(engine_chunks(WEATHER_CALL), stream=True, tools=[WEATHER])
    validate_event_stream(events)
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == '{"city":"Paris"}'
    assert "response.function_call_arguments.done" in types(events)
    response = events[-1]["response"]
    assert (events[-1]["type"], response["status"]) == ("response.completed", "completed")
    reasoning, call = response["output"]
    assert reasoning["type"] == "reasoning"
    assert (call["type"], call["name"], call["arguments"], call["status"]) == (
        "function_call",
        "get_weather",
        '{"city":"Paris"}',
        "completed",
    )
    assert call["call_id"].startswith("call_")


async def test_a_failure_mid_stream_closes_the_open_items_and_ends_with_response_failed() -> None:
    completion = ANSWER.replace("Hello", "Hello there, it is sunny")
    cut = engine_chunks(completion, per_chunk=2)[:-1]  # the engine fails inside the answer
    events, ctx = await run_response(cut, UpstreamTimeout("no token within 30s"), stream=True)
    validate_event_stream(events)
    assert types(events)[-2:] == ["response.output_item.done", "response.failed"]
    response = events[-1]["response"]
    assert response["status"] == "failed"
    assert response["error"] == {"code": "server_error", "message": "no token within 30s"}
    assert [(item["type"], item["status"]) for item in response["output"]] == [
        ("reasoning", "completed"),
        ("message", "incomplete"),
    ]
    assert ctx.status == 504
    stored = await serving_state().store.get_response(response["id"], ctx.owner)
    assert stored is not None and stored.status == "failed"  # as OpenAI keeps failed responses


async def test_the_json_body_has_the_same_items() -> None:
    body, ctx = await run_response(engine_chunks(ANSWER))
    assert (body["object"], body["model"], body["status"]) == ("response", MODEL, "completed")
    reasoning, message = body["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert [part["text"] for part in message["content"]] == ["Hello"]
    assert body["usage"]["output_tokens"] == len(harmony_ids(ANSWER)) == ctx.completion_tokens
