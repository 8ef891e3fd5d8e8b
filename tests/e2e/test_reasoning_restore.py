"""Reasoning that survives tool turns for stateless clients: Responses `encrypted_content` (AEAD under the
gateway key, shared through the storage), Chat Completions and Anthropic Messages restoring the analysis
by the tool call ids the gateway issued, and the Harmony rule that a final answer drops older analysis."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.pipeline.reasoning_store import reasoning_vault
from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.processes import start_gateway_process
from tests.support.servers import RunningGateway, running_gateway, test_settings

ANALYSIS = "The user mentioned get_weather. I will call functions.get_weather."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = "Use get_weather for Paris"


def last_prompt(sim: RunningSim) -> str:
    return get_encoding().decode(sim.requests[-1].input_ids)


def encrypted_only(item: dict[str, Any]) -> dict[str, Any]:
    """A reasoning item as a client that keeps only the opaque blob sends it back."""
    return {
        "type": "reasoning",
        "id": item["id"],
        "summary": [],
        "encrypted_content": item["encrypted_content"],
    }


async def first_turn(http: httpx.AsyncClient, *, stream: bool = False) -> list[dict[str, Any]]:
    body = {
        "model": MODEL,
        "input": ASK,
        "tools": [WEATHER],
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    r = await http.post("/responses", json=body)
    assert r.status_code == 200, r.text
    return r.json()["output"]  # type: ignore[no-any-return]


async def second_turn(
    http: httpx.AsyncClient, output: list[dict[str, Any]], reasoning: dict[str, Any]
) -> Any:
    call = output[-1]
    assert call["type"] == "function_call"
    body = {
        "model": MODEL,
        "store": False,
        "tools": [WEATHER],
        "input": [
            {"type": "message", "role": "user", "content": ASK},
            reasoning,
            call,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21C"},
        ],
    }
    return await http.post("/responses", json=body)


async def test_encrypted_reasoning_round_trip_with_store_false(
    gateway: RunningGateway, sim: RunningSim
) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        output = await first_turn(http)
        reasoning = output[0]
        assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"].startswith("hg1.")
        assert ANALYSIS not in reasoning["encrypted_content"]
        r = await second_turn(http, output, encrypted_only(reasoning))
        assert r.status_code == 200, r.text
        assert "sunny, 21C" in r.json()["output"][-1]["content"][0]["text"]
    prompt = last_prompt(sim)
    assert f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>" in prompt


async def test_streamed_reasoning_items_carry_encrypted_content(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(
        model=MODEL,
        input=ASK,
        tools=[WEATHER],
        store=False,
        include=["reasoning.encrypted_content"],
        stream=True,
    )
    done: list[Any] = []
    completed = None
    async for event in stream:
        if event.type == "response.output_item.done" and event.item.type == "reasoning":
            done.append(event.item)
        if event.type == "response.completed":
            completed = event.response
    assert completed is not None and done
    assert done[0].encrypted_content == completed.output[0].encrypted_content  # type: ignore[union-attr]
    plain = await client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], store=False)
    assert plain.output[0].encrypted_content is None  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["flip", "foreign", "garbage"])
async def test_tampered_encrypted_reasoning_is_400(gateway: RunningGateway, how: str) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        output = await first_turn(http)
        blob = output[0]["encrypted_content"]
        if how == "flip":
            raw = bytearray(base64.urlsafe_b64decode(blob[4:] + "=" * (-len(blob[4:]) % 4)))
            raw[20] ^= 1
            blob = "hg1." + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
        elif how == "foreign":
            blob = "gAAAAABlZ0aW5nIHNvbWUgb3RoZXIgc2VydmVyJ3MgYmxvYg=="
        else:
            blob = "hg1.!!!"
        r = await second_turn(http, output, dict(output[0], encrypted_content=blob))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input[1].encrypted_content" and error["type"] == "invalid_request_error"


async def test_another_gateway_process_on_the_same_storage_opens_it(sim: RunningSim, tmp_path: Path) -> None:
    storage = ["--storage", f"sqlite:///{tmp_path / 'gw.db'}", "--worker-url", sim.url]
    first = await start_gateway_process(*storage)
    try:
        async with httpx.AsyncClient(base_url=first.base_url, timeout=30) as http:
            output = await first_turn(http)
    finally:
        first.stop()
    second = await start_gateway_process(*storage)  # a restart: the generated key is read back
    third = await start_gateway_process("--worker-url", sim.url)  # other storage: another key
    try:
        async with httpx.AsyncClient(base_url=second.base_url, timeout=30) as http:
            r = await second_turn(http, output, encrypted_only(output[0]))
            assert r.status_code == 200, r.text
        assert f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>" in last_prompt(sim)
        async with httpx.AsyncClient(base_url=third.base_url, timeout=30) as http:
            r = await second_turn(http, output, encrypted_only(output[0]))
            assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].encrypted_content"
    finally:
        second.stop()
        third.stop()


# -- Chat Completions ------------------------------------------------------------------------------

CHAT_WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


async def chat_tool_turn(client: openai.AsyncOpenAI, stream: bool) -> tuple[str, Any]:
    """(analysis, tool call) of a first turn, as the client saw them."""
    messages: Any = [{"role": "user", "content": ASK}]
    if not stream:
        r = await client.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_WEATHER])
        message = r.choices[0].message
        return (message.model_extra or {})["reasoning_content"], message.tool_calls[0]  # type: ignore[index]
    analysis, call_id, name, arguments = "", "", "", ""
    chunks = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=[CHAT_WEATHER], stream=True
    )
    async for chunk in chunks:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        analysis += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or ():
            call_id = call.id or call_id
            name = (call.function.name if call.function else None) or name
            arguments += (call.function.arguments if call.function else None) or ""
    return analysis, openai.types.chat.ChatCompletionMessageToolCall(
        id=call_id, type="function", function={"name": name, "arguments": arguments}
    )


def replay(call: Any, reasoning: str | None = None) -> list[Any]:
    assistant: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return [
        {"role": "user", "content": ASK},
        assistant,
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_restores_the_analysis_of_its_tool_calls(
    client: openai.AsyncOpenAI, sim: RunningSim, stream: bool
) -> None:
    analysis, call = await chat_tool_turn(client, stream)
    assert analysis == ANALYSIS and call.id.startswith("call_")
    r = await client.chat.completions.create(model=MODEL, messages=replay(call), tools=[CHAT_WEATHER])
    assert "sunny, 21C" in (r.choices[0].message.content or "")
    assert f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>" in last_prompt(sim)
    # What the client sends wins.
    await client.chat.completions.create(
        model=MODEL, messages=replay(call, "My own notes."), tools=[CHAT_WEATHER]
    )
    prompt = last_prompt(sim)
    assert "<|channel|>analysis<|message|>My own notes.<|end|>" in prompt and ANALYSIS not in prompt
    # After a final answer and a new user message, no earlier analysis is rendered.
    later = [
        *replay(call),
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    await client.chat.completions.create(model=MODEL, messages=later, tools=[CHAT_WEATHER])
    prompt = last_prompt(sim)
    assert ANALYSIS not in prompt and "<|channel|>analysis" not in prompt.split("Thanks")[0]


async def test_chat_restore_is_shared_through_the_storage(sim: RunningSim, tmp_path: Path) -> None:
    storage = ["--storage", f"sqlite:///{tmp_path / 'gw.db'}", "--worker-url", sim.url]
    first, second = await start_gateway_process(*storage), await start_gateway_process(*storage)
    try:
        async with openai.AsyncOpenAI(base_url=first.base_url, api_key="k", max_retries=0) as c1:
            _, call = await chat_tool_turn(c1, stream=False)
        async with openai.AsyncOpenAI(base_url=second.base_url, api_key="k", max_retries=0) as c2:
            await c2.chat.completions.create(model=MODEL, messages=replay(call), tools=[CHAT_WEATHER])
        assert f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>" in last_prompt(sim)
    finally:
        first.stop()
        second.stop()


# -- Anthropic Messages ----------------------------------------------------------------------------

ANTHROPIC_WEATHER: Any = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_restore_the_analysis_of_their_tool_uses(
    gateway: RunningGateway, sim: RunningSim, stream: bool
) -> None:
    request: Any = {
        "model": MODEL,
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [ANTHROPIC_WEATHER],
    }
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="k", max_retries=0, timeout=30) as c:
        ask = [{"role": "user", "content": ASK}]
        if stream:
            async with c.messages.stream(**request, messages=ask) as s:
                first = await s.get_final_message()
        else:
            first = await c.messages.create(**request, messages=ask)
        thinking = next(b for b in first.content if b.type == "thinking")
        use = next(b for b in first.content if b.type == "tool_use")
        assert thinking.thinking == ANALYSIS
        vault = await reasoning_vault(gateway.state, "")  # the open gateway's tenant
        assert vault.verify(thinking.thinking, thinking.signature)
        assert not vault.verify("something else", thinking.signature)
        result = {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        }
        tool_use = use.model_dump(exclude_none=True)
        await c.messages.create(
            **request, messages=[*ask, {"role": "assistant", "content": [tool_use]}, result]
        )
        assert f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>" in last_prompt(sim)
        own = {"type": "thinking", "thinking": "My own notes.", "signature": "x"}
        await c.messages.create(
            **request, messages=[*ask, {"role": "assistant", "content": [own, tool_use]}, result]
        )
        prompt = last_prompt(sim)
        assert "<|channel|>analysis<|message|>My own notes.<|end|>" in prompt and ANALYSIS not in prompt
        later = [
            *ask,
            {"role": "assistant", "content": [tool_use]},
            result,
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "Thanks"},
        ]
        await c.messages.create(**request, messages=later)
        assert ANALYSIS not in last_prompt(sim)


async def test_a_configured_key_is_shared_without_shared_storage(sim: RunningSim) -> None:
    settings = test_settings(worker_urls=(sim.url,), reasoning_key="operator-secret")
    async with running_gateway(settings) as a, running_gateway(settings) as b:
        async with httpx.AsyncClient(base_url=a.base_url, timeout=30) as http:
            output = await first_turn(http)
        async with httpx.AsyncClient(base_url=b.base_url, timeout=30) as http:
            r = await second_turn(http, output, encrypted_only(output[0]))
            assert r.status_code == 200, r.text
    assert f"<|channel|>analysis<|message|>{ANALYSIS}<|end|>" in last_prompt(sim)
