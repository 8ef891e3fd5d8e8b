"""Chat Completions framed as data: a plan (`plan_chat`) answered with real Harmony token ids as engine
chunks, its `chat.completion.chunk` events or `chat.completion` body read back as JSON."""

from __future__ import annotations

from typing import Any

from harmony_gateway.errors import UpstreamTimeout
from harmony_gateway.pipeline.context import RequestContext
from harmony_gateway.surfaces.chat.framer import reasoning_keys
from harmony_gateway.surfaces.chat.run import plan_chat
from harmony_gateway.surfaces.chat.types import ChatCompletionRequest
from tests.harmony.test_render import WEATHER_TOOL
from tests.surfaces._support import (
    ANSWER,
    MODEL,
    PROMPT_TOKENS,
    REQUEST_ID,
    WEATHER_CALL,
    Event,
    answered,
    engine_chunks,
    harmony_ids,
    openai_context,
    serving_state,
)

USER = [{"role": "user", "content": "Weather in Paris?"}]


async def run_chat(
    items: list[Any], fail: BaseException | None = None, **body: Any
) -> tuple[Any, RequestContext]:
    ctx = openai_context("chat")
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": USER, **body})
    planned = await plan_chat(serving_state(), request, ctx)
    return await answered(ctx, planned, items, fail), ctx


def reasoning(text: str) -> dict[str, str]:
    return dict.fromkeys(reasoning_keys(serving_state().settings.reasoning_fields), text)


def deltas(events: list[Event]) -> list[tuple[int, dict[str, Any], str | None]]:
    """(choice index, delta, finish_reason) of every chunk, after checking each is a chunk of this
    completion with one choice."""
    out = []
    for name, chunk in events[:-1]:
        assert name is None
        assert (chunk["id"], chunk["object"], chunk["model"]) == (
            f"chatcmpl-{REQUEST_ID}",
            "chat.completion.chunk",
            MODEL,
        )
        (choice,) = chunk["choices"]
        out.append((choice["index"], choice["delta"], choice["finish_reason"]))
    return out


async def test_a_stream_is_role_reasoning_content_finish_then_done() -> None:
    events, ctx = await run_chat(engine_chunks(ANSWER), stream=True)
    assert deltas(events) == [
        (0, {"role": "assistant", "content": ""}, None),
        (0, reasoning("think"), None),
        (0, {"content": "Hello"}, None),
        (0, {}, "stop"),
    ]
    assert events[-1] == (None, "[DONE]")
    assert "usage" not in events[0][1]  # only when stream_options.include_usage asks for it
    assert ctx.completion_tokens == len(harmony_ids(ANSWER))
    assert ctx.prompt_tokens > 0 and ctx.status == 200


async def test_a_tool_call_streams_its_id_type_and_name_then_its_arguments() -> None:
    events, _ = await run_chat(engine_chunks(WEATHER_CALL), stream=True, tools=[WEATHER_TOOL])
    chunks = deltas(events)
    assert chunks[0][1] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for _, d, _ in chunks) == "need weather"
    calls = [d["tool_calls"] for _, d, _ in chunks if "tool_calls" in d]
    assert all(len(entries) == 1 and entries[0]["index"] == 0 for entries in calls)
    opener, *rest = [entries[0] for entries in calls]
    assert opener["id"].startswith("call_")
    assert (opener["type"], opener["function"]["name"]) == ("function", "get_weather")
    assert all(set(entry) == {"index", "function"} for entry in rest)  # id, type and name once
    arguments = "".join(entry["function"]["arguments"] for entry in [opener, *rest])
    assert arguments == '{"city":"Paris"}'
    assert chunks[-1] == (0, {}, "tool_calls")
    assert events[-1] == (None, "[DONE]")


async def test_usage_is_the_last_chunk_when_asked_for() -> None:
    events, _ = await run_chat(engine_chunks(ANSWER), stream=True, stream_options={"include_usage": True})
    assert all(chunk["usage"] is None for _, chunk in events[:-2])
    usage_chunk = events[-2][1]
    assert usage_chunk["choices"] == []
    completion = len(harmony_ids(ANSWER))
    assert usage_chunk["usage"]["prompt_tokens"] == PROMPT_TOKENS
    assert usage_chunk["usage"]["completion_tokens"] == completion
    assert usage_chunk["usage"]["total_tokens"] == PROMPT_TOKENS + completion
    assert usage_chunk["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    assert events[-1] == (None, "[DONE]")


async def test_each_choice_has_its_role_and_finish_chunk() -> None:
    first, second = engine_chunks(ANSWER, index=0), engine_chunks(ANSWER, index=1)
    interleaved = [chunk for pair in zip(first, second, strict=True) for chunk in pair]
    events, _ = await run_chat(interleaved, stream=True, n=2)
    chunks = deltas(events)
    assert chunks[:2] == [
        (0, {"role": "assistant", "content": ""}, None),
        (1, {"role": "assistant", "content": ""}, None),
    ]
    for index in (0, 1):
        mine = [(d, finish) for i, d, finish in chunks[2:] if i == index]
        assert mine == [(reasoning("think"), None), ({"content": "Hello"}, None), ({}, "stop")]


async def test_a_stop_string_ends_the_answer_before_it() -> None:
    completion = "<|channel|>final<|message|>Sunny today. Rain tomorrow and after.<|return|>"
    events, ctx = await run_chat(engine_chunks(completion, per_chunk=2), stream=True, stop=["."])
    chunks = deltas(events)
    assert "".join(d.get("content", "") for _, d, _ in chunks) == "Sunny today"
    assert [finish for _, _, finish in chunks if finish] == ["stop"]
    assert ctx.completion_tokens < len(harmony_ids(completion))  # the rest was never read


async def test_a_failure_mid_stream_ends_with_the_openai_error_then_done() -> None:
    chunks = engine_chunks(ANSWER)
    events, ctx = await run_chat(chunks[:1], UpstreamTimeout("no token within 30s"), stream=True)
    assert events[-2:] == [
        (
            None,
            {
                "error": {
                    "message": "no token within 30s",
                    "type": UpstreamTimeout.error_type,
                    "param": None,
                    "code": UpstreamTimeout.code,
                }
            },
        ),
        (None, "[DONE]"),
    ]
    assert not any(finish for _, _, finish in deltas(events[:-1]))  # no finish chunk before it
    assert ctx.status == 504


async def test_the_json_body_has_reasoning_and_content() -> None:
    body, ctx = await run_chat(engine_chunks(ANSWER))
    assert (body["id"], body["object"], body["model"]) == (f"chatcmpl-{REQUEST_ID}", "chat.completion", MODEL)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {
        "role": "assistant",
        "content": "Hello",
        **reasoning("think"),
        "tool_calls": None,
    }
    completion = len(harmony_ids(ANSWER))
    assert body["usage"]["completion_tokens"] == completion == ctx.completion_tokens
    assert body["usage"]["prompt_tokens"] == PROMPT_TOKENS


async def test_the_json_body_of_a_tool_call() -> None:
    body, _ = await run_chat(engine_chunks(WEATHER_CALL), tools=[WEATHER_TOOL])
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_")
    assert (call["type"], call["function"]) == (
        "function",
        {"name": "get_weather", "arguments": '{"city":"Paris"}'},
    )
