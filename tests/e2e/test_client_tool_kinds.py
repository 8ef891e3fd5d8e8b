"""Every tool kind Codex declares comes back in the shape it expects: `custom` (freeform) tools such as
`apply_patch` with a grammar as `custom_tool_call` items with `input`, `local_shell` as `local_shell_call`
items with an `exec` action; their outputs replay into the next turn."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.responses_stream import validate_event_stream
from tests.support.servers import RunningGateway

GRAMMAR = (
    'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?'
)
APPLY_PATCH: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR},
}


def prompt_of(sim: RunningSim) -> str:
    return get_encoding().decode(sim.requests[-1].input_ids)


async def _sse(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    async with http.stream("POST", "/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    validate_event_stream(events)
    return events


async def test_custom_tool_call_round_trip(gateway: RunningGateway, sim: RunningSim) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": "Use apply_patch for main.py", "tools": [APPLY_PATCH]}
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        r = await http.post("/responses", json=body)
        assert r.status_code == 200, r.text
        call = r.json()["output"][-1]
        assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch"
        assert call["call_id"].startswith("call_") and call["input"] == "{}" and call["status"] == "completed"
        developer = prompt_of(sim)
        assert "type apply_patch = () => any;" in developer and "*** Begin Patch" in developer
        events = await _sse(http, body)
        streamed = events[-1]["response"]["output"][-1]
        assert streamed["type"] == "custom_tool_call"
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
        done = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
        assert deltas == streamed["input"] == done[0]["input"]
        follow = {
            "model": MODEL,
            "tools": [APPLY_PATCH],
            "input": [
                {"role": "user", "content": "Use apply_patch for main.py"},
                call,
                {
                    "type": "custom_tool_call_output",
                    "call_id": call["call_id"],
                    "output": "Done! 1 file changed",
                },
            ],
        }
        r = await http.post("/responses", json=follow)
        assert r.status_code == 200, r.text
        assert "Done! 1 file changed" in r.json()["output"][-1]["content"][0]["text"]
    prompt = prompt_of(sim)
    assert (
        "assistant to=functions.apply_patch<|channel|>commentary<|message|>{}<|call|>" in prompt
    )  # no json type
    assert (
        "<|start|>functions.apply_patch to=assistant<|channel|>commentary<|message|>Done! 1 file changed"
        in prompt
    )


async def test_local_shell_call_round_trip(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    tools: Any = [{"type": "local_shell"}]
    r = await client.responses.create(model=MODEL, input="Use local_shell for ls", tools=tools)
    call = r.output[-1]
    assert call.type == "local_shell_call"
    assert call.action.type == "exec" and call.action.command == [] and call.call_id.startswith("call_")
    assert "type local_shell = (_: {" in prompt_of(sim)
    r2 = await client.responses.create(
        model=MODEL,
        tools=tools,
        input=[
            {"role": "user", "content": "Use local_shell for ls"},
            call.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"type": "local_shell_call_output", "id": call.call_id, "output": "README.md"},  # type: ignore[list-item]
        ],
    )
    assert "README.md" in r2.output_text
    assert (
        "<|start|>functions.local_shell to=assistant<|channel|>commentary<|message|>README.md"
        in prompt_of(sim)
    )


async def test_custom_tool_without_a_name_is_400(client: openai.AsyncOpenAI) -> None:
    try:
        await client.responses.create(model=MODEL, input="hi", tools=[{"type": "custom"}])  # type: ignore[list-item]
    except openai.BadRequestError as exc:
        assert exc.param == "tools[0].name"
    else:
        raise AssertionError("expected a 400")
