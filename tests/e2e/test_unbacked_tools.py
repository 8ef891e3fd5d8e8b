"""Hosted tools nothing backs are left out of the prompt (default `--unbacked-tools drop`), logged once
per type and counted; the request succeeds."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.servers import RunningGateway, running_gateway, test_settings

HOSTED: list[Any] = [
    {"type": "web_search", "external_web_access": False},
    {"type": "web_search_preview"},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "image_generation"},
    {"type": "computer_use_preview", "display_width": 1024, "display_height": 768, "environment": "linux"},
]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


async def test_unbacked_hosted_tools_are_dropped(
    client: openai.AsyncOpenAI, gateway: RunningGateway, sim: RunningSim
) -> None:
    tools: Any = [*HOSTED, WEATHER]
    r = await client.responses.create(model=MODEL, input="use get_weather for Paris", tools=tools)
    assert r.output[-1].type == "function_call" and r.output[-1].name == "get_weather"
    assert [t.type for t in r.tools] == [t["type"] for t in tools]  # echoed as sent
    prompt = get_encoding().decode(sim.requests[-1].input_ids)
    assert "namespace functions" in prompt
    assert "## browser" not in prompt and "## python" not in prompt
    r = await client.responses.create(model=MODEL, input="hello", tools=HOSTED, stream=False)
    assert r.status == "completed" and r.output_text
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(gateway.url + "/metrics")).text
    for kind in ("web_search", "file_search", "image_generation", "computer_use_preview"):
        assert f'gateway_unbacked_tools_dropped_total{{type="{kind}"}}' in metrics


async def test_unsupported_tool_errors_keep_the_clients_index(client: openai.AsyncOpenAI) -> None:
    try:
        await client.responses.create(
            model=MODEL,
            input="hi",
            tools=[{"type": "web_search"}, {"type": "function"}],  # type: ignore[list-item]
        )
    except openai.BadRequestError as exc:
        assert exc.param == "tools[1].name"
    else:
        raise AssertionError("a function tool without a name must be refused")


async def test_anthropic_server_tools_are_dropped_or_rejected(
    gateway: RunningGateway, sim: RunningSim
) -> None:
    body: Any = {
        "model": MODEL,
        "max_tokens": 256,
        "messages": [{"role": "user", "content": "hello"}],
        "tools": [
            {"type": "web_search_20250305", "name": "web_search"},
            {
                "name": "Bash",
                "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
            },
        ],
    }
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="k", max_retries=0) as c:
        r = await c.messages.create(**body)
        assert r.stop_reason == "end_turn"
    prompt = get_encoding().decode(sim.requests[-1].input_ids)
    assert "type Bash" in prompt and "web_search" not in prompt
    async with running_gateway(test_settings(worker_urls=(sim.url,), unbacked_tools="reject")) as strict:
        async with anthropic.AsyncAnthropic(base_url=strict.url, api_key="k", max_retries=0) as c:
            with pytest.raises(anthropic.BadRequestError) as info:
                await c.messages.create(**body)
    assert "tools[0].type" in info.value.body["error"]["message"]
