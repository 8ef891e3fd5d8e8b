"""The per-request tool set's bookkeeping: one `max_tool_calls` count for the calls the model makes and
the calls the user approved, and approval requests issued under the tenant's ids."""

from __future__ import annotations

from harmony_gateway.mcp.approval import ApprovalIds
from harmony_gateway.mcp.client import McpTool
from harmony_gateway.mcp.pool import PoolLimits
from harmony_gateway.mcp.tool_loop import APPROVAL, EXECUTE, OVER_LIMIT, BoundServer, ToolLoop
from harmony_gateway.pipeline.reasoning_store import ReasoningVault
from harmony_gateway.storage.memory import MemoryStore

IDS = ApprovalIds(b"k" * 32, "tenant-a")


def tool_loop(max_calls: int, approval: str = "never") -> ToolLoop:
    loop = ToolLoop(
        None, max_calls=max_calls, limits=PoolLimits(tool_timeout=1.0, max_output_chars=100), approval_ids=IDS
    )
    tools = {"search": McpTool("search", "", {})}
    loop.servers["docs"] = BoundServer("docs", None, tools, approval, owned=False)  # type: ignore[arg-type]
    return loop


def test_approved_calls_and_model_calls_share_the_limit() -> None:
    loop = tool_loop(max_calls=2)
    assert loop.take_call()  # a call the user approved
    assert loop.decide("docs.search").kind == EXECUTE
    assert not loop.take_call()
    assert loop.decide("docs.search").kind == OVER_LIMIT
    assert (loop.calls, loop.over_limit) == (2, 2)


def test_approval_requests_are_issued_for_the_tenant_and_call() -> None:
    loop = tool_loop(max_calls=1, approval="always")
    decision = loop.decide("docs.search")
    assert decision.kind == APPROVAL and loop.calls == 0  # asking is not running
    item = loop.approval_request(decision, '{"query":"x"}')
    assert item == {
        "type": "mcp_approval_request",
        "id": item["id"],
        "server_label": "docs",
        "name": "search",
        "arguments": '{"query":"x"}',
    }
    assert IDS.issued(item) and not ApprovalIds(b"k" * 32, "tenant-b").issued(item)


def test_replicas_with_one_gateway_key_derive_one_approval_key() -> None:
    key = b"g" * 32
    one, other = ReasoningVault(key, MemoryStore(), owner="a"), ReasoningVault(key, MemoryStore(), owner="b")
    assert one.subkey(b"mcp") == other.subkey(b"mcp") != one.subkey(b"other")
    assert one.subkey(b"mcp") != ReasoningVault(b"h" * 32, MemoryStore(), owner="a").subkey(b"mcp")
