"""Names a client sends that reach a Harmony header or the response-format section, which openai-harmony
encodes itself (its BPE is quadratic in a piece's length): a history tool call's name on every surface
and a response format's name are bounded like the parser bounds the model's own header fields, so one
request cannot hold a worker for seconds per 100,000 letters, nor park megabytes in the frame cache."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import MODEL
from tests.support.servers import RunningGateway

#: Far past the 256 characters a header field may hold; openai-harmony took about half a second on it.
LONG = "a" * 20_000


def _bodies() -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "chat tool call": (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": LONG, "arguments": "{}"}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                ],
            },
        ),
        "responses function_call": (
            "/v1/responses",
            {
                "model": MODEL,
                "max_output_tokens": 4,
                "input": [
                    {"type": "message", "role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": LONG + "b", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                ],
            },
        ),
        "messages tool_use": (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": LONG + "c", "input": {}}],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}],
                    },
                ],
            },
        ),
        "chat response_format": (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": LONG + "d", "schema": {"type": "object"}},
                },
            },
        ),
        "responses text.format": (
            "/v1/responses",
            {
                "model": MODEL,
                "max_output_tokens": 4,
                "input": "hi",
                "text": {"format": {"type": "json_schema", "name": LONG + "e", "schema": {"type": "object"}}},
            },
        ),
    }


@pytest.mark.parametrize("name", list(_bodies()))
async def test_an_overlong_name_is_a_400(gateway: RunningGateway, name: str) -> None:
    path, body = _bodies()[name]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        response = await http.post(path, json=body)
    assert response.status_code == 400, response.text[:300]
    assert LONG not in response.text


async def test_names_within_the_bound_still_render(gateway: RunningGateway) -> None:
    """A name as long as the parser lets the model write one is fine (and unusual names echo back)."""
    name = "n" * 200
    body = _bodies()["chat tool call"][1]
    body["messages"][1]["tool_calls"][0]["function"]["name"] = name
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        response = await http.post("/v1/harmony/render", json={"api": "chat", "request": body})
    assert response.status_code == 200, response.text[:300]
    assert f"to=functions.{name}" in response.json()["prompt_text"]


async def test_tool_calls_count_as_messages(gateway: RunningGateway) -> None:
    """Tens of thousands of tool calls in two messages are held to the bound on messages, as Responses
    `function_call` items are to the bound on input items."""
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": ""}} for i in range(5000)
    ]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}],
    }
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] == "messages"


async def test_tool_use_blocks_count_as_messages(gateway: RunningGateway) -> None:
    """Each tool_use and tool_result block becomes a message of the prompt, so they count against the
    bound on messages too."""
    uses = [{"type": "tool_use", "id": f"t{i}", "name": "f", "input": {}} for i in range(5000)]
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": uses}],
    }
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        response = await http.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]  # Anthropic's shape: the field is named in the message
    assert error["type"] == "invalid_request_error"
    assert "messages" in error["message"] and "tool blocks" in error["message"]
