"""Tool names follow OpenAI's rule (1 to 64 letters, digits, underscores or dashes; Anthropic's is the
same) on every surface that declares tools: a 400 naming the field, before the name reaches a prompt
or the structural tag sent to engines."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.servers import RunningGateway

BAD_NAMES = [
    "x" * 65,
    "get weather",
    "get.weather",
    "get_weather<|call|>",
    'a","schema":{}}',
    "wetter_für_stadt",
    "get_weather\n",
    "",
]
GOOD_NAMES = ["get_weather", "Get-Weather_2", "x" * 64, "_", "-"]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}}


def _chat(name: str) -> tuple[str, dict[str, Any]]:
    tool = {"type": "function", "function": {"name": name, "parameters": PARAMETERS}}
    return "/v1/chat/completions", {
        "model": MODEL,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "other"}}, tool],
        "tool_choice": "required",
    }


def _responses(kind: str) -> Any:
    def body(name: str) -> tuple[str, dict[str, Any]]:
        tool: dict[str, Any] = {"type": kind, "name": name}
        if kind == "namespace":
            tool["tools"] = [{"type": "function", "name": "lookup"}]
        return "/v1/responses", {
            "model": MODEL,
            "input": "weather?",
            "tools": [{"type": "function", "name": "other"}, tool],
        }

    return body


def _namespace_member(name: str) -> tuple[str, dict[str, Any]]:
    member = {"type": "function", "name": name, "parameters": PARAMETERS}
    return "/v1/responses", {
        "model": MODEL,
        "input": "weather?",
        "tools": [
            {"type": "function", "name": "other"},
            {"type": "namespace", "name": "geo", "tools": [member]},
        ],
    }


def _messages(name: str) -> tuple[str, dict[str, Any]]:
    return "/v1/messages", {
        "model": MODEL,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "other", "input_schema": {}}, {"name": name, "input_schema": PARAMETERS}],
    }


SURFACES = {
    "chat": (_chat, "tools[1].function.name"),
    "responses-function": (_responses("function"), "tools[1].name"),
    "responses-custom": (_responses("custom"), "tools[1].name"),
    "responses-namespace": (_responses("namespace"), "tools[1].name"),
    "responses-namespace-member": (_namespace_member, "tools[1].tools[0].name"),
    "messages": (_messages, "tools[1].name"),
}


@pytest.mark.parametrize("surface", SURFACES)
async def test_a_bad_tool_name_is_a_400_naming_the_field(
    gateway: RunningGateway, sim: RunningSim, surface: str
) -> None:
    build, param = SURFACES[surface]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        before = len(sim.requests)
        for name in BAD_NAMES:
            path, body = build(name)
            r = await http.post(path, json=body)
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            if surface == "messages":
                assert error["type"] == "invalid_request_error" and param in error["message"]
            else:
                assert error["param"] == param, (name, error)
                assert error["type"] == "invalid_request_error"
            assert "letters, digits, underscores or dashes" in error["message"]
        assert len(sim.requests) == before  # nothing reached an engine


@pytest.mark.parametrize("surface", SURFACES)
async def test_good_tool_names_pass(gateway: RunningGateway, surface: str) -> None:
    build, _ = SURFACES[surface]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        for name in GOOD_NAMES:
            path, body = build(name)
            r = await http.post(path, json=body)
            assert r.status_code == 200, (name, r.text)
