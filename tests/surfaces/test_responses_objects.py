"""The Response object builders (surfaces/responses/objects.py), without a server: every status, every
echoed tool kind and a body stored by an earlier version are valid against the published schemas."""

from __future__ import annotations

from typing import Any

import pytest

from harmony_gateway.engines.base import SamplingOptions
from harmony_gateway.surfaces.responses.objects import (
    complete_response,
    echoed_tools,
    ended_response,
    response_envelope,
    response_snapshot,
    usage_of,
)
from harmony_gateway.surfaces.responses.types import ResponsesRequest
from tests.support.published_schemas import assert_valid_response, response_problems

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "plain"},
    {
        "type": "function",
        "name": "full",
        "description": "d",
        "parameters": {"type": "object"},
        "strict": True,
    },
    {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
    {"type": "local_shell"},
    {"type": "namespace", "name": "crm", "tools": [{"type": "function", "name": "lookup"}]},
    {
        "type": "mcp",
        "server_label": "docs",
        "server_url": "https://mcp.example/mcp",
        "headers": {"Authorization": "Bearer secret"},
        "authorization": "secret",
        "require_approval": "never",
    },
    {"type": "web_search_preview"},
    {"type": "code_interpreter"},
]
MESSAGE = {
    "type": "message",
    "id": "msg_1",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}],
}


def envelope(**request: Any) -> dict[str, Any]:
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", **request})
    sampling = SamplingOptions(temperature=0.7, top_p=0.9, presence_penalty=0.1)
    return response_envelope(req, "resp_1", 1_700_000_000, "m", "medium", sampling)


@pytest.mark.parametrize(
    ("status", "extra"),
    [
        ("queued", {}),
        ("in_progress", {}),
        ("completed", {"completed_at": 1_700_000_001}),
        ("incomplete", {"incomplete_reason": "max_output_tokens"}),
        ("failed", {"error": {"code": "server_error", "message": "engine crashed"}}),
        ("cancelled", {}),
    ],
)
def test_every_status_is_a_valid_response(status: str, extra: dict[str, Any]) -> None:
    body = response_snapshot(envelope(tools=TOOLS), status, [MESSAGE], usage_of(10, 5, 2, 4), **extra)
    assert_valid_response(body)
    assert body["completed_at"] == (1_700_000_001 if status == "completed" else None)


def test_a_snapshot_before_the_end_counts_nothing_yet() -> None:
    body = response_snapshot(envelope(), "in_progress", [], None, completed_at=1)
    assert body["completed_at"] is None and body["usage"]["total_tokens"] == 0
    assert_valid_response(body)


def test_the_envelope_echoes_sampling_as_applied_and_identifiers_as_sent() -> None:
    body = envelope(safety_identifier="u-1", prompt_cache_key="k", top_logprobs=4, user="someone")
    assert (body["temperature"], body["top_p"], body["presence_penalty"], body["frequency_penalty"]) == (
        0.7,
        0.9,
        0.1,
        0.0,
    )
    assert body["safety_identifier"] == "u-1" and body["prompt_cache_key"] == "k"
    assert body["top_logprobs"] == 4 and body["service_tier"] == "default" and body["user"] == "someone"
    bare = envelope()
    assert bare["top_logprobs"] == 0 and bare["safety_identifier"] is None and "user" not in bare
    assert envelope(text={"verbosity": "low"})["text"] == {"format": {"type": "text"}, "verbosity": "low"}


@pytest.mark.parametrize(
    "request_fields",
    [
        {"tool_choice": {"type": "mcp", "server_label": "docs"}},
        {"tool_choice": {"type": "web_search_preview"}},
        {"tool_choice": {"type": "custom", "name": "apply_patch"}},
        {"tool_choice": {"type": "function", "name": "plain"}},
        {
            "tool_choice": {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": "f"}],
            }
        },
        {
            "text": {
                "format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
            }
        },
        {"text": {"format": {"type": "json_object"}}},
        {
            "reasoning": {"effort": "low", "summary": "auto"},
            "truncation": "auto",
            "max_tool_calls": 3,
            "max_output_tokens": 100,
            "instructions": "Be brief.",
            "previous_response_id": "resp_0",
            "parallel_tool_calls": False,
        },
        {"conversation": "conv_1"},
    ],
)
def test_echoed_request_fields_are_valid(request_fields: dict[str, Any]) -> None:
    assert_valid_response(response_snapshot(envelope(tools=TOOLS, **request_fields), "completed", [], None))


def test_tools_are_echoed_complete_and_without_secrets() -> None:
    echoed = echoed_tools(TOOLS)
    assert echoed[0] == {
        "type": "function",
        "name": "plain",
        "description": None,
        "parameters": None,
        "strict": None,
    }
    assert echoed[1] == TOOLS[1]
    assert echoed[4]["description"] == "" and echoed[4]["tools"][0]["strict"] is None
    assert "headers" not in echoed[5] and "authorization" not in echoed[5]
    assert echoed[7]["container"] == {"type": "auto"}
    assert TOOLS[0] == {"type": "function", "name": "plain"}  # the request is left as it was


def test_a_body_stored_by_an_earlier_version_is_completed() -> None:
    body = response_snapshot(envelope(tools=TOOLS[:1]), "completed", [MESSAGE], usage_of(1, 1, 0, 0))
    for key in ("completed_at", "presence_penalty", "frequency_penalty", "service_tier"):
        del body[key]
    for key in ("safety_identifier", "prompt_cache_key"):
        del body[key]
    body.update(top_logprobs=None, user=None, usage=None, tools=TOOLS[:1])
    assert response_problems(body)
    completed = complete_response(body)
    assert_valid_response(completed)
    assert completed["output"] == [MESSAGE] and "user" not in completed


def test_a_response_ended_from_outside_its_run() -> None:
    running = response_snapshot(envelope(), "in_progress", [], None)
    cancelled = ended_response(running, "cancelled")
    assert cancelled["status"] == "cancelled" and cancelled["error"] is None
    failed = ended_response(running, "failed", {"code": "server_error", "message": "restarted"})
    for body in (cancelled, failed):
        assert_valid_response(body)
