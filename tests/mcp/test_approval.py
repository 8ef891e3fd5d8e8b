"""Approval policies and matching approval responses to requests."""

from __future__ import annotations

import pytest

from harmony_gateway.errors import InvalidRequest
from harmony_gateway.mcp.approval import match_approvals, needs_approval, validate_policy
from harmony_gateway.mcp.client import McpTool

READER = McpTool("read", "", {}, {"readOnlyHint": True})
WRITER = McpTool("write", "", {})


@pytest.mark.parametrize(
    ("policy", "tool", "expected"),
    [
        (None, WRITER, True),  # OpenAI's default: ask unless told never
        ("always", READER, True),
        ("never", WRITER, False),
        ({"never": {"tool_names": ["write"]}}, WRITER, False),
        ({"never": {"tool_names": ["write"]}}, READER, True),
        ({"always": {"tool_names": ["read"]}, "never": {"tool_names": ["read"]}}, READER, True),
        ({"never": {"read_only": True}}, READER, False),
        ({"never": {"read_only": True}}, WRITER, True),
    ],
)
def test_needs_approval(policy, tool, expected) -> None:
    assert needs_approval(policy, tool, tool.name) is expected


def test_invalid_policy() -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_policy({"sometimes": {}}, param="tools[0].require_approval")
    assert info.value.param == "tools[0].require_approval"


def test_match_approvals() -> None:
    request = {
        "type": "mcp_approval_request",
        "id": "mcpr_1",
        "server_label": "d",
        "name": "x",
        "arguments": "{}",
    }
    items = [
        {"type": "message", "role": "user", "content": []},
        {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": False, "reason": "no"},
    ]
    (decision,) = match_approvals(items, [request])
    assert decision.request is request and not decision.approve and decision.reason == "no"
    assert decision.position == 1
    with pytest.raises(InvalidRequest) as info:
        match_approvals(
            [{"type": "mcp_approval_response", "approval_request_id": "mcpr_2", "approve": True}], [request]
        )
    assert info.value.param == "input[0].approval_request_id"
    answered = [request, {"type": "mcp_call", "approval_request_id": "mcpr_1"}]
    with pytest.raises(InvalidRequest, match="already answered"):
        match_approvals(items, answered)
