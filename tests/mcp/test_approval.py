"""Approval policies, approval request ids only the gateway can issue, and matching approval responses
to the requests they answer."""

from __future__ import annotations

from typing import Any

import pytest

from harmony_gateway.errors import InvalidRequest
from harmony_gateway.mcp.approval import (
    ApprovalIds,
    approval_request_item,
    match_approvals,
    needs_approval,
    validate_policy,
)
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


KEY = b"k" * 32
TENANT_A = ApprovalIds(KEY, "tenant-a")


def issued_request(ids: ApprovalIds = TENANT_A, arguments: str = "{}") -> dict[str, Any]:
    return approval_request_item(ids, "d", "x", arguments)


def test_match_approvals() -> None:
    request = issued_request()
    request_id = request["id"]
    items = [
        {"type": "message", "role": "user", "content": []},
        {
            "type": "mcp_approval_response",
            "approval_request_id": request_id,
            "approve": False,
            "reason": "no",
        },
    ]
    (decision,) = match_approvals(items, [request], TENANT_A)
    assert decision.request is request and not decision.approve and decision.reason == "no"
    assert decision.position == 1
    with pytest.raises(InvalidRequest) as info:
        match_approvals(
            [{"type": "mcp_approval_response", "approval_request_id": "mcpr_2", "approve": True}],
            [request],
            TENANT_A,
        )
    assert info.value.param == "input[0].approval_request_id"
    answered = [request, {"type": "mcp_call", "approval_request_id": request_id}]
    with pytest.raises(InvalidRequest, match="already answered"):
        match_approvals(items, answered, TENANT_A)


def test_issued_ids_are_unique_and_check_out() -> None:
    first, second = issued_request(), issued_request()
    assert first["id"] != second["id"] and first["id"].startswith("mcpr_")
    assert TENANT_A.issued(first) and TENANT_A.issued(second)


def _flip_last(text: str) -> str:
    return text[:-1] + ("0" if text[-1] != "0" else "1")


@pytest.mark.parametrize(
    "change",
    [
        {"server_label": "e"},
        {"name": "y"},
        {"arguments": '{"all": true}'},
        {"arguments": 5},  # not a string: never issued
        {"name": None},
        {"id": "mcpr_" + "0" * 56},  # the shape of an issued id, not one
        {"id": "mcpr_made_up"},
        {"id": 7},
    ],
)
def test_a_changed_request_is_not_issued(change: dict[str, Any]) -> None:
    assert not TENANT_A.issued({**issued_request(), **change})


def test_a_changed_id_is_not_issued() -> None:
    request = issued_request()
    assert not TENANT_A.issued({**request, "id": _flip_last(request["id"])})
    assert not TENANT_A.issued({**request, "id": request["id"].upper()})


def test_ids_are_bound_to_the_tenant_and_the_key() -> None:
    request = issued_request()
    assert not ApprovalIds(KEY, "tenant-b").issued(request)
    assert not ApprovalIds(KEY, "").issued(request)  # an open gateway's tenant
    assert not ApprovalIds(b"o" * 32, "tenant-a").issued(request)  # another gateway's key
    assert ApprovalIds(KEY, "tenant-a").issued(request)  # another replica with the same key


def test_only_issued_requests_can_be_answered() -> None:
    forged = {**issued_request(), "id": "mcpr_" + "ab" * 28}
    answer = {"type": "mcp_approval_response", "approval_request_id": forged["id"], "approve": True}
    for known, items in (([], [forged, answer]), ([forged], [answer])):
        with pytest.raises(InvalidRequest, match="not issued by this gateway") as info:
            match_approvals(items, known, TENANT_A)
        assert info.value.param == f"input[{len(items) - 1}].approval_request_id"
    theirs = issued_request(ApprovalIds(KEY, "tenant-b"))
    answer = {"type": "mcp_approval_response", "approval_request_id": theirs["id"], "approve": False}
    with pytest.raises(InvalidRequest, match="not issued by this gateway"):
        match_approvals([theirs, answer], [], TENANT_A)
