"""Responses API end to end: official SDK → gateway (real HTTP) → sim engine (real gRPC)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from tests.conftest import MODEL
from tests.support.responses_stream import validate_event_stream
from tests.support.servers import client_request_ids

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}},
        "required": ["location"],
    },
}


def last_prompt(sim) -> str:
    return get_encoding().decode(sim.requests[-1].input_ids)


async def test_non_stream_has_reasoning_and_message(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model=MODEL, input="What is 2+2?")
    assert r.status == "completed"
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].id.startswith("rs_") and r.output[0].content[0].text.startswith("The user wrote")
    assert "simulated answer" in r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    assert r.usage.input_tokens_details.cached_tokens >= 0
    fetched = await client.responses.retrieve(r.id)
    assert fetched.output_text == r.output_text


async def test_stream_events_parse_and_final_response_matches(client: openai.AsyncOpenAI) -> None:
    events = []
    async with client.responses.stream(model=MODEL, input="Tell me something") as stream:
        async for event in stream:
            events.append(event)
        final = await stream.get_final_response()
    validate_event_stream([e.model_dump(exclude_unset=True, warnings=False) for e in events])
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    streamed_ids = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert [item.id for item in final.output] == streamed_ids
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == final.output[0].content[0].text
    stored = await client.responses.retrieve(final.id)
    assert stored.output_text == final.output_text


async def test_function_call_and_continuation(client: openai.AsyncOpenAI, sim) -> None:
    r = await client.responses.create(
        model=MODEL, input="What is the weather in Paris? use get_weather", tools=[WEATHER_TOOL]
    )
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    r2 = await client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}],
    )
    assert "Sunny, 24 C" in r2.output_text
    prompt = last_prompt(sim)
    assert "to=functions.get_weather" in prompt and "Sunny, 24 C" in prompt


async def test_three_turn_chain_carries_history(client: openai.AsyncOpenAI, sim) -> None:
    r1 = await client.responses.create(model=MODEL, input="first question about apples")
    r2 = await client.responses.create(
        model=MODEL, input="second question about pears", previous_response_id=r1.id
    )
    await client.responses.create(model=MODEL, input="third question", previous_response_id=r2.id)
    prompt = last_prompt(sim)
    assert "first question about apples" in prompt and "second question about pears" in prompt


async def test_unknown_previous_response_is_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")
    assert info.value.code == "previous_response_not_found"
    assert info.value.param == "previous_response_id"


async def test_store_false_and_delete(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model=MODEL, input="do not keep", store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    kept = await client.responses.create(model=MODEL, input="keep then delete")
    await client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(kept.id)


async def test_input_items_pagination(client: openai.AsyncOpenAI) -> None:
    items = [{"role": "user", "content": f"message {i}"} for i in range(5)]
    r = await client.responses.create(model=MODEL, input=items)
    page = await client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["message 0", "message 1"]
    assert page.has_more
    rest = await client.responses.input_items.list(r.id, after=page.data[-1].id, order="asc")
    assert [i.content[0].text for i in rest.data] == ["message 2", "message 3", "message 4"]
    assert not rest.has_more


async def test_conversation_of_two_turns(client: openai.AsyncOpenAI, sim) -> None:
    conv = await client.conversations.create(metadata={"topic": "fruit"})
    await client.responses.create(model=MODEL, input="tell me about bananas", conversation=conv.id)
    await client.responses.create(model=MODEL, input="and about kiwis", conversation=conv.id)
    assert "tell me about bananas" in last_prompt(sim)
    items = await client.conversations.items.list(conv.id, order="asc")
    kinds = [(i.type, getattr(i, "role", None)) for i in items.data]
    assert kinds == [
        ("message", "user"),
        ("reasoning", None),
        ("message", "assistant"),
        ("message", "user"),
        ("reasoning", None),
        ("message", "assistant"),
    ]
    fetched = await client.conversations.retrieve(conv.id)
    assert fetched.metadata == {"topic": "fruit"}


async def test_max_output_tokens_incomplete(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model=MODEL, input="[[long]] think a lot", max_output_tokens=20)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == "incomplete"


async def test_background_poll_and_cancel(gateway, sim) -> None:
    from harmony_gateway.sim import SimConfig, start_sim_engine
    from tests.support.servers import running_gateway, test_settings

    async with await start_sim_engine(SimConfig(tokens_per_second=30)) as slow:
        async with running_gateway(test_settings(worker_urls=(slow.url,))) as gw:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as c:
                r = await c.responses.create(model=MODEL, input="hello there", background=True)
                assert r.status == "queued"
                for _ in range(200):
                    polled = await c.responses.retrieve(r.id)
                    if polled.status == "completed":
                        break
                    await asyncio.sleep(0.05)
                assert polled.status == "completed" and "simulated answer" in polled.output_text

                long = await c.responses.create(model=MODEL, input="[[long]] slow one", background=True)
                await asyncio.sleep(0.3)
                cancelled = await c.responses.cancel(long.id)
                assert cancelled.status == "cancelled"
                # This response's own engine request was aborted (its request id is the engine's).
                assert long._request_id and long._request_id in client_request_ids(slow.aborted)
                with pytest.raises(openai.BadRequestError):
                    await c.responses.cancel(r.id)
