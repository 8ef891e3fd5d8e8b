"""Real clients on the Responses API: openai-agents (OpenAIResponsesModel) and the Codex CLI."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from tests.conftest import MODEL
from tests.support.responses_stream import validate_event_stream

DATA = Path(__file__).parent / "data"
set_tracing_disabled(True)


@function_tool
def get_weather(city: str) -> str:
    """Get the weather for a city."""
    return f"It is sunny in {city}."


def _agent(client: openai.AsyncOpenAI, tools: list | None = None) -> Agent:
    return Agent(
        name="assistant",
        instructions="Answer briefly.",
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        tools=tools or [],
    )


async def test_agents_responses_model_plain_and_tool(client: openai.AsyncOpenAI) -> None:
    result = await Runner.run(_agent(client), "What is 2+2?")
    assert "simulated answer" in result.final_output
    result = await Runner.run(_agent(client, [get_weather]), "Call get_weather for Paris")
    assert "It is sunny in" in result.final_output


async def test_agents_run_streamed(client: openai.AsyncOpenAI) -> None:
    run = Runner.run_streamed(_agent(client, [get_weather]), "Please use get_weather for Rome")
    kinds = set()
    async for event in run.stream_events():
        kinds.add(event.type)
    assert "raw_response_event" in kinds
    assert "It is sunny in" in run.final_output


async def _sse_events(response: httpx.Response) -> list[dict]:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            events.append(json.loads(line[6:]))
    return events


async def test_codex_request_shape_round_trip(gateway) -> None:
    """Codex's own request as its default configuration sends it (developer messages, function and namespace
    tools, web_search with no browser backing, client_metadata, include of encrypted reasoning, store false)
    streams, calls its tool, continues."""
    body = json.loads((DATA / "codex_responses_request.json").read_text())
    assert any(t["type"] == "web_search" for t in body["tools"])
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        async with http.stream("POST", "/responses", json=body) as r:
            assert r.status_code == 200
            events = await _sse_events(r)
        validate_event_stream(events)
        final = events[-1]["response"]
        call = final["output"][-1]
        assert call["type"] == "function_call" and call["name"] == "exec_command"
        follow = dict(body)
        follow["input"] = [
            *body["input"],
            *final["output"],
            {"type": "function_call_output", "call_id": call["call_id"], "output": "/home/user"},
        ]
        async with http.stream("POST", "/responses", json=follow) as r:
            events = await _sse_events(r)
        validate_event_stream(events)
        answer = events[-1]["response"]["output"][-1]
        assert answer["type"] == "message" and "/home/user" in answer["content"][0]["text"]


async def test_namespace_tool_calls_carry_namespace(client: openai.AsyncOpenAI, sim) -> None:
    tools = [
        {
            "type": "namespace",
            "name": "crm",
            "description": "Customer records",
            "tools": [
                {
                    "type": "function",
                    "name": "lookup_customer",
                    "parameters": {"type": "object", "properties": {"email": {"type": "string"}}},
                }
            ],
        }
    ]
    r = await client.responses.create(model=MODEL, input="please lookup_customer for bob", tools=tools)
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "lookup_customer" and call.namespace == "crm"
    r2 = await client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        tools=tools,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Bob, premium"}],
    )
    assert "Bob, premium" in r2.output_text
    from harmony_gateway.harmony.encoding import get_encoding

    prompt = get_encoding().decode(sim.requests[-1].input_ids)
    assert "namespace crm" in prompt and "crm.lookup_customer to=assistant" in prompt


@pytest.mark.skipif(
    shutil.which("codex") is None, reason="the Codex CLI is not installed (npm i -g @openai/codex)"
)
async def test_codex_cli_exec(gateway, tmp_path) -> None:
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "gw"\n\n'
        f'[model_providers.gw]\nname = "harmony-gateway"\nbase_url = "{gateway.base_url}"\n'
        'wire_api = "responses"\nenv_key = "GW_KEY"\n'
    )
    env = dict(os.environ, CODEX_HOME=str(home), GW_KEY="test")
    proc = await asyncio.create_subprocess_exec(
        "codex",
        "exec",
        "--skip-git-repo-check",
        "Say hello in one sentence",
        cwd=tmp_path,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode()[-2000:]
    assert "Say hello in one sentence" in out.decode() and "simulated answer" in out.decode()
