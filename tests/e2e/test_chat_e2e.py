"""Chat Completions end to end: the official openai SDK → gateway (uvicorn on loopback) → simulated gpt-oss
engine (real gRPC). Streams must rebuild the non-stream objects; errors must map to the SDK's classes."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any
from unittest import mock

import httpx
import openai
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support import servers
from tests.support.servers import (
    RunningGateway,
    client_request_id,
    client_request_ids,
    running_gateway,
    wait_until,
)

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "Use get_weather: what is the weather in Paris?"}]


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def reasoning_of(obj: Any) -> str | None:
    extra = obj.model_extra or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")  # both names, same text
    return extra.get("reasoning_content")


async def collect(stream: Any) -> dict[int, dict[str, Any]]:
    """Rebuild each choice of a chat stream: role, content, reasoning, tool calls, finish reason."""
    out: dict[int, dict[str, Any]] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            acc = out.setdefault(
                choice.index,
                {"role": None, "content": "", "reasoning": "", "tool_calls": {}, "finish": None, "chunks": 0},
            )
            acc["chunks"] += 1
            delta = choice.delta
            if acc["chunks"] == 1:
                acc["role"] = delta.role
            acc["content"] += delta.content or ""
            acc["reasoning"] += reasoning_of(delta) or ""
            for call in delta.tool_calls or ():
                entry = acc["tool_calls"].setdefault(
                    call.index, {"id": None, "name": None, "arguments": "", "pieces": 0}
                )
                if call.id:
                    assert entry["id"] is None, "a call is opened once"
                    entry["id"], entry["name"] = call.id, call.function.name
                entry["arguments"] += call.function.arguments or ""
                entry["pieces"] += 1
            if choice.finish_reason:
                acc["finish"] = choice.finish_reason
    return out


async def test_non_stream_answer(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model=MODEL, messages=user("What is the capital of France?"))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    [choice] = r.choices
    assert choice.finish_reason == "stop"
    assert choice.message.role == "assistant"
    assert choice.message.content == 'You said: "What is the capital of France?". This is a simulated answer.'
    assert reasoning_of(choice.message) == "The user wrote 6 words. I will answer briefly."
    assert choice.message.tool_calls is None
    usage = r.usage
    assert usage is not None
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens_details.reasoning_tokens < usage.completion_tokens


async def test_stream_rebuilds_the_non_stream_answer(client: openai.AsyncOpenAI) -> None:
    messages = user("Explain streaming please [[long]]")
    whole = await client.chat.completions.create(model=MODEL, messages=messages)
    stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
    [acc] = (await collect(stream)).values()
    assert acc["role"] == "assistant"
    assert acc["content"] == whole.choices[0].message.content
    assert acc["reasoning"] == reasoning_of(whole.choices[0].message)
    assert len(acc["reasoning"]) > 1000
    assert acc["finish"] == "stop"
    assert acc["chunks"] > 20  # streamed per token, not in one piece


async def test_stream_usage_chunk(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=user("Count my tokens"), stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    *body, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens_details.reasoning_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(chunk.usage is None for chunk in body)
    assert len({chunk.id for chunk in chunks}) == 1
    whole = await client.chat.completions.create(model=MODEL, messages=user("Count my tokens"))
    assert whole.usage == last.usage


async def test_n_2_non_stream_and_stream(client: openai.AsyncOpenAI) -> None:
    messages = user("Give me two answers")
    r = await client.chat.completions.create(model=MODEL, messages=messages, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    first, second = (c.message.content for c in r.choices)
    assert first != second and second.endswith("(choice 1)")
    stream = await client.chat.completions.create(model=MODEL, messages=messages, n=2, stream=True)
    accs = await collect(stream)
    assert sorted(accs) == [0, 1]
    assert [accs[i]["content"] for i in (0, 1)] == [first, second]
    assert all(accs[i]["role"] == "assistant" and accs[i]["finish"] == "stop" for i in (0, 1))


async def test_tool_call_non_stream_and_stream(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL])
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert reasoning_of(choice.message)
    assert choice.message.content is None

    stream = await client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], stream=True
    )
    [acc] = (await collect(stream)).values()
    assert acc["finish"] == "tool_calls"
    [streamed] = acc["tool_calls"].values()
    assert streamed["id"].startswith("call_") and streamed["name"] == "get_weather"
    assert streamed["arguments"] == call.function.arguments
    assert streamed["pieces"] > 1  # opener, then argument pieces
    assert acc["reasoning"] == reasoning_of(choice.message)


async def test_tool_round_trip_to_a_final_answer(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    first = await client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL])
    [call] = first.choices[0].message.tool_calls
    request_id = uuid.uuid4().hex
    messages = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": reasoning_of(first.choices[0].message),
            "tool_calls": [call.model_dump()],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"},
    ]
    r = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], extra_headers={"x-request-id": request_id}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == 'The tool functions.get_weather returned: "18C and sunny".'
    [seen] = [req for req in sim.requests if client_request_id(req.request_id) == request_id]
    prompt = get_encoding().decode_utf8(seen.input_ids)
    assert (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
        + call.function.arguments
        + "<|call|>"
    ) in prompt
    assert (
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18C and sunny<|end|>"
        in prompt
    )
    assert prompt.endswith("<|start|>assistant")


async def test_max_tokens_cut_keeps_partial_text(client: openai.AsyncOpenAI) -> None:
    messages = user("Please answer at length")
    full = await client.chat.completions.create(model=MODEL, messages=messages)
    limit = full.usage.completion_tokens - 4
    r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=limit)
    [choice] = r.choices
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == limit
    content = choice.message.content
    assert (
        content
        and full.choices[0].message.content.startswith(content)
        and content != full.choices[0].message.content
    )
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=limit, stream=True
    )
    [acc] = (await collect(stream)).values()
    assert (acc["content"], acc["finish"]) == (content, "length")


async def test_max_tokens_inside_the_first_header_is_an_empty_reply(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content is None


async def test_logprobs_are_rejected(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=user("Hi"), logprobs=True)
    assert info.value.status_code == 400
    assert info.value.body["message"] == "logprobs are not supported for Harmony models"  # type: ignore[index]
    assert info.value.param == "logprobs"
    assert info.value.type == "invalid_request_error"


async def test_unknown_model(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="no-such-model", messages=user("Hi"))
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 5}, "temperature"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in this picture?"},
                            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                        ],
                    }
                ]
            },
            "messages[0].content[1]",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"reasoning_effort": "none"}, "reasoning_effort"),
        ({"n": 0}, "n"),
        ({"messages": []}, "messages"),
    ],
)
async def test_invalid_fields_are_400_with_param(
    client: openai.AsyncOpenAI, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": user("Hi"), **extra}
    request_id = uuid.uuid4().hex
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(**body, extra_headers={"x-request-id": request_id})
    assert info.value.param == param
    assert info.value.request_id == request_id


async def test_junk_output_is_502_and_a_stream_error_event(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        await client.chat.completions.create(model=MODEL, messages=user("Say something [[junk]]"))
    assert info.value.status_code == 502
    stream = await client.chat.completions.create(
        model=MODEL, messages=user("Say something [[junk]]"), stream=True
    )
    with pytest.raises(openai.APIError) as streamed:
        async for chunk in stream:
            for choice in chunk.choices:
                assert "<|" not in (choice.delta.content or "")
    assert "Harmony" in streamed.value.message


@pytest.mark.parametrize(
    ("trigger", "content_check"),
    [
        ("[[refusal]]", lambda c: c == "I'm sorry, but I can't help with that."),
        ("[[trailing]]", lambda c: c.endswith("This is a simulated answer.")),
        ("[[preamble]]", lambda c: c.startswith("Let me put the answer together.\nYou said:")),
        ("[[unicode]]", lambda c: c.startswith("Unicode check: 你好，世界 🌍🚀 — naïve café ✓ 漢字テスト. ")),
    ],
)
async def test_quirky_outputs_parse_cleanly(
    client: openai.AsyncOpenAI, trigger: str, content_check: Any
) -> None:
    messages = user(f"Answer this {trigger}")
    r = await client.chat.completions.create(model=MODEL, messages=messages)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert content_check(message.content), message.content
    reasoning = reasoning_of(message)
    assert reasoning and reasoning.count("The ") == 1 and "<|" not in reasoning
    stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
    [acc] = (await collect(stream)).values()
    assert (acc["content"], acc["reasoning"], acc["finish"]) == (message.content, reasoning, "stop")


async def test_stop_strings_cut_the_answer_not_the_reasoning(client: openai.AsyncOpenAI) -> None:
    messages = user("Tell me what you will do next")
    r = await client.chat.completions.create(model=MODEL, messages=messages, stop=["will"])
    message = r.choices[0].message
    assert message.content == 'You said: "Tell me what you '
    assert reasoning_of(message) == "The user wrote 7 words. I will answer briefly."
    assert r.choices[0].finish_reason == "stop"
    stream = await client.chat.completions.create(model=MODEL, messages=messages, stop="will", stream=True)
    [acc] = (await collect(stream)).values()
    assert (acc["content"], acc["reasoning"], acc["finish"]) == (
        message.content,
        reasoning_of(message),
        "stop",
    )


async def test_request_id_is_honoured_and_echoed(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    request_id = "req-" + uuid.uuid4().hex
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=user("Hi"), extra_headers={"x-request-id": request_id}
    )
    assert raw.headers["x-request-id"] == request_id
    assert raw.parse().id == "chatcmpl-" + request_id
    assert any(client_request_id(req.request_id) == request_id for req in sim.requests)
    generated = await client.chat.completions.with_raw_response.create(model=MODEL, messages=user("Hi"))
    assert generated.headers["x-request-id"]


async def test_models_are_created_when_the_gateway_started(gateway: RunningGateway) -> None:
    """`created` is the gateway's start time: the same on every call, never the time of the call."""
    asked_at = time.time()
    later = asked_at + 3600.0
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        with mock.patch("time.time", return_value=later):  # the gateway's clock: an hour on
            first = (await http.get("/v1/models")).json()["data"][0]["created"]
            second = (await http.get("/v1/models")).json()["data"][0]["created"]
            retrieved = (await http.get(f"/v1/models/{MODEL}")).json()["created"]
    assert first == second == retrieved
    assert first <= asked_at


async def test_models_health_and_readiness(client: openai.AsyncOpenAI, gateway: RunningGateway) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        assert (await http.get("/health")).status_code == 200
        ready = await http.get("/readiness")
        assert ready.status_code == 200 and ready.json()["models"] == [MODEL]


async def test_engine_stopped_is_503_and_readiness_fails() -> None:
    engine = await start_sim_engine(SimConfig(port=0, model=MODEL))
    settings = servers.test_settings(worker_urls=(engine.url,), health_failure_threshold=1)
    async with (
        running_gateway(settings) as gw,
        openai.AsyncOpenAI(base_url=gw.base_url, api_key="test", max_retries=0, timeout=10) as client,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        r = await client.chat.completions.create(model=MODEL, messages=user("Hi"))
        assert r.choices[0].message.content
        await engine.stop()
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=user("Hi"))
        assert info.value.status_code == 503
        for _ in range(100):  # health probes fail after health_interval (0.5 s)
            ready = await http.get("/readiness")
            if ready.status_code == 503:
                break
            await asyncio.sleep(0.05)
        assert ready.status_code == 503
        error = (await http.get("/readiness")).json()["error"]
        assert error["type"] == "server_error"


async def test_client_disconnect_aborts_the_engine_request() -> None:
    async with (
        await start_sim_engine(SimConfig(port=0, model=MODEL, tokens_per_second=20)) as engine,
        running_gateway(servers.test_settings(worker_urls=(engine.url,))) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
    ):
        request_id = "disconnect-" + uuid.uuid4().hex
        body = {"model": MODEL, "messages": user("Tell me a long story [[long]]"), "stream": True}
        async with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-request-id": request_id}
        ) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
        await wait_until(lambda: request_id in client_request_ids(engine.aborted), timeout=5)
        await wait_until(lambda: engine.active_requests == 0, timeout=5)


async def test_two_calls_in_one_turn(client: openai.AsyncOpenAI) -> None:
    messages = user("Use get_weather in Paris [[two_calls]]")
    r = await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert calls[0].id != calls[1].id
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], stream=True
    )
    [acc] = (await collect(stream)).values()
    assert sorted(acc["tool_calls"]) == [0, 1]
    assert [acc["tool_calls"][i]["arguments"] for i in (0, 1)] == [c.function.arguments for c in calls]
    assert acc["finish"] == "tool_calls"


async def test_engine_that_strips_stop_tokens() -> None:
    """The last message still closes: a refusal header and a call whose `<|call|>` was not sent."""
    async with (
        await start_sim_engine(SimConfig(port=0, model=MODEL, strip_stop_token=True)) as engine,
        running_gateway(servers.test_settings(worker_urls=(engine.url,))) as gw,
        openai.AsyncOpenAI(base_url=gw.base_url, api_key="test", max_retries=0, timeout=10) as client,
    ):
        refusal = await client.chat.completions.create(model=MODEL, messages=user("Do it [[refusal]]"))
        assert refusal.choices[0].message.content == "I'm sorry, but I can't help with that."
        for stream in (False, True):
            r = await client.chat.completions.create(
                model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL], stream=stream
            )
            if stream:
                [acc] = (await collect(r)).values()
                assert acc["finish"] == "tool_calls"
            else:
                assert r.choices[0].finish_reason == "tool_calls"
                assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["city"] == "Paris"
