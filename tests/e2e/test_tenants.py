"""Two tenants on one gateway: tenant B replays every id and blob of tenant A's on every route.

The suite is driven from the OpenAPI spec: every operation is classified below (which of A's values it
is given, or why it holds no tenant state), and a test fails when an operation is missing, so a new route
is covered by default. For each replay B gets 404 or 400, and nothing of A's (A's secret text) reaches
B's answer, the prompt the engine receives for B, the logs or the metrics; A's objects stay intact.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim
from harmony_gateway.traffic.keys import read_key_file
from tests.conftest import MODEL
from tests.support.servers import RunningGateway, running_gateway, test_settings, wait_until

KEY_A, KEY_B = "sk-tenant-a-0001", "sk-tenant-b-0002"
SECRET = "Zanzibar-7f3a-private"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
ASK = f"Use get_weather for {SECRET}"

#: Every operation of the spec, by what the suite gives B of A's. "ids": the path's ids are A's.
#: "body": B's body carries A's ids or blobs (`test_b_replays_a_values_in_request_bodies`). "open": the
#: route holds no tenant state; B's answer must still show nothing of A's. "admin": the admin plane.
ROUTES: dict[tuple[str, str], str] = {
    ("post", "/v1/chat/completions"): "body",
    ("post", "/v1/responses"): "body",
    ("post", "/v1/responses/compact"): "body",
    ("post", "/v1/responses/input_tokens"): "body",
    ("post", "/v1/messages"): "body",
    ("post", "/v1/messages/count_tokens"): "body",
    ("post", "/v1/harmony/render"): "body",
    ("post", "/v1/harmony/parse"): "open",
    ("post", "/generate"): "open",
    ("post", "/v1/completions"): "open",
    ("post", "/v1/conversations"): "body",
    ("get", "/v1/responses/{response_id}"): "ids",
    ("delete", "/v1/responses/{response_id}"): "ids",
    ("post", "/v1/responses/{response_id}/cancel"): "ids",
    ("get", "/v1/responses/{response_id}/input_items"): "ids",
    ("get", "/v1/conversations/{conversation_id}"): "ids",
    ("post", "/v1/conversations/{conversation_id}"): "ids",
    ("delete", "/v1/conversations/{conversation_id}"): "ids",
    ("get", "/v1/conversations/{conversation_id}/items"): "ids",
    ("post", "/v1/conversations/{conversation_id}/items"): "ids",
    ("get", "/v1/conversations/{conversation_id}/items/{item_id}"): "ids",
    ("delete", "/v1/conversations/{conversation_id}/items/{item_id}"): "ids",
    ("get", "/v1/models"): "open",
    ("get", "/v1/models/{model_id}"): "open",
    ("get", "/health"): "open",
    ("get", "/readiness"): "open",
    ("get", "/metrics"): "open",
    ("get", "/"): "open",
    ("get", "/playground"): "open",
    ("get", "/playground/static/{name}"): "open",
    ("get", "/workers"): "admin",
    ("post", "/workers"): "admin",
    ("delete", "/workers/{worker_id}"): "admin",
}

#: Bodies for the operations whose path ids are A's (the ids are filled in per test).
ID_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("post", "/v1/conversations/{conversation_id}"): {"metadata": {"owner": "b"}},
    ("post", "/v1/conversations/{conversation_id}/items"): {
        "items": [{"type": "message", "role": "user", "content": "B was here"}]
    },
}


@dataclass
class TenantA:
    response_id: str
    conversation_id: str
    item_id: str
    reasoning_item: dict[str, Any]
    function_call: dict[str, Any]
    chat_call_id: str
    thinking: dict[str, Any]
    tool_use: dict[str, Any]
    compaction_item: dict[str, Any]


@pytest.fixture(scope="module")
async def tenants(sim: RunningSim) -> AsyncIterator[RunningGateway]:
    settings = test_settings(worker_urls=(sim.url,), api_keys=frozenset({KEY_A, KEY_B}))
    async with running_gateway(settings) as gw:
        yield gw


def as_tenant(gateway: RunningGateway, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gateway.url, headers={"authorization": f"Bearer {key}"}, timeout=30)


async def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
async def tenant_a(tenants: RunningGateway) -> TenantA:
    async with as_tenant(tenants, KEY_A) as a:
        stored = await _ok(
            await a.post("/v1/responses", json={"model": MODEL, "input": SECRET, "store": True})
        )
        conversation = await _ok(
            await a.post(
                "/v1/conversations",
                json={"items": [{"type": "message", "role": "user", "content": SECRET}]},
            )
        )
        items = await _ok(await a.get(f"/v1/conversations/{conversation['id']}/items"))
        encrypted = await _ok(
            await a.post(
                "/v1/responses",
                json={
                    "model": MODEL,
                    "input": ASK,
                    "tools": [WEATHER],
                    "store": False,
                    "include": ["reasoning.encrypted_content"],
                },
            )
        )
        chat = await _ok(
            await a.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": ASK}],
                    "tools": [CHAT_WEATHER],
                },
            )
        )
        message = await _ok(
            await a.post(
                "/v1/messages",
                json={
                    "model": MODEL,
                    "max_tokens": 1024,
                    "thinking": {"type": "enabled", "budget_tokens": 512},
                    "tools": [{"name": "get_weather", "input_schema": WEATHER["parameters"]}],
                    "messages": [{"role": "user", "content": ASK}],
                },
            )
        )
        compacted = await _ok(
            await a.post(
                "/v1/responses/compact",
                json={"model": MODEL, "previous_response_id": stored["id"], "input": "Summarise."},
            )
        )
    by_type = {item["type"]: item for item in encrypted["output"]}
    blocks = {block["type"]: block for block in message["content"]}
    return TenantA(
        response_id=stored["id"],
        conversation_id=conversation["id"],
        item_id=items["data"][0]["id"],
        reasoning_item=by_type["reasoning"],
        function_call=by_type["function_call"],
        chat_call_id=chat["choices"][0]["message"]["tool_calls"][0]["id"],
        thinking=blocks["thinking"],
        tool_use=blocks["tool_use"],
        compaction_item=compacted["output"][-1],
    )


def assert_nothing_of_a(response: httpx.Response) -> None:
    assert SECRET not in response.text
    assert response.status_code < 500, response.text


async def test_every_operation_in_the_spec_is_classified(tenants: RunningGateway) -> None:
    async with as_tenant(tenants, KEY_A) as a:
        spec = await _ok(await a.get("/openapi.json"))
    operations = {(method, path) for path, ops in spec["paths"].items() for method in ops}
    assert operations == set(ROUTES), "classify the new operation in ROUTES (and cover it in this suite)"


def _fill(path: str, a: TenantA) -> str:
    return path.format(response_id=a.response_id, conversation_id=a.conversation_id, item_id=a.item_id)


@pytest.mark.parametrize("operation", [op for op, kind in ROUTES.items() if kind == "ids"], ids=str)
async def test_b_replaying_a_ids_in_a_path_finds_nothing(
    tenants: RunningGateway, tenant_a: TenantA, operation: tuple[str, str]
) -> None:
    method, path = operation
    async with as_tenant(tenants, KEY_B) as b, as_tenant(tenants, KEY_A) as a:
        r = await b.request(method.upper(), _fill(path, tenant_a), json=ID_BODIES.get(operation))
        assert r.status_code == 404, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert_nothing_of_a(r)
        # A's objects are untouched by whatever B tried.
        assert (await a.get(f"/v1/responses/{tenant_a.response_id}")).status_code == 200
        conversation = await _ok(await a.get(f"/v1/conversations/{tenant_a.conversation_id}"))
        assert conversation["metadata"] == {}
        items = await _ok(await a.get(f"/v1/conversations/{tenant_a.conversation_id}/items"))
        assert [item["id"] for item in items["data"]] == [tenant_a.item_id]


def _replays(a: TenantA) -> list[tuple[str, str, dict[str, Any], set[int]]]:
    """(name, path, B's body, accepted statuses) for every id or blob of A's that a body can carry."""
    encrypted_only = {
        "type": "reasoning",
        "id": a.reasoning_item["id"],
        "summary": [],
        "encrypted_content": a.reasoning_item["encrypted_content"],
    }
    # B knows A's ids (they leak through logs, screenshots, a shared proxy), never A's content: what B
    # sends back is A's ids with B's own arguments.
    function_call = {**a.function_call, "arguments": '{"city": "Paris"}'}
    tool_use = {**a.tool_use, "input": {"city": "Paris"}}
    call_output = {"type": "function_call_output", "call_id": a.function_call["call_id"], "output": "sunny"}
    chat_replay = [
        {"role": "user", "content": "Use get_weather for Paris"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": a.chat_call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": a.chat_call_id, "content": "sunny"},
    ]
    messages_replay = [
        {"role": "user", "content": "Use get_weather for Paris"},
        {"role": "assistant", "content": [tool_use]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": a.tool_use["id"], "content": "ok"}],
        },
    ]
    signed = [
        {"role": "user", "content": "Use get_weather for Paris"},
        {"role": "assistant", "content": [a.thinking, tool_use]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": a.tool_use["id"], "content": "ok"}],
        },
    ]
    anthropic = {
        "model": MODEL,
        "max_tokens": 256,
        "tools": [{"name": "get_weather", "input_schema": WEATHER["parameters"]}],
    }
    responses = {"model": MODEL, "tools": [WEATHER]}
    return [
        (
            "previous_response_id",
            "/v1/responses",
            {**responses, "previous_response_id": a.response_id, "input": "hi"},
            {400, 404},
        ),
        (
            "conversation",
            "/v1/responses",
            {**responses, "conversation": a.conversation_id, "input": "hi"},
            {404},
        ),
        (
            "render previous_response_id",
            "/v1/harmony/render",
            {
                "api": "responses",
                "request": {**responses, "previous_response_id": a.response_id, "input": "hi"},
            },
            {400, 404},
        ),
        (
            "render conversation",
            "/v1/harmony/render",
            {"api": "responses", "request": {**responses, "conversation": a.conversation_id, "input": "hi"}},
            {404},
        ),
        (
            "compact previous_response_id",
            "/v1/responses/compact",
            {"model": MODEL, "previous_response_id": a.response_id},
            {400, 404},
        ),
        (
            "input_tokens previous_response_id",
            "/v1/responses/input_tokens",
            {**responses, "previous_response_id": a.response_id, "input": "hi"},
            {400, 404},
        ),
        (
            "input_tokens conversation",
            "/v1/responses/input_tokens",
            {**responses, "conversation": a.conversation_id, "input": "hi"},
            {404},
        ),
        (
            "compaction encrypted_content",
            "/v1/responses",
            {**responses, "store": False, "input": [a.compaction_item, {"role": "user", "content": "hi"}]},
            {400},
        ),
        (
            "compaction encrypted_content in a token count",
            "/v1/responses/input_tokens",
            {**responses, "input": [a.compaction_item]},
            {400},
        ),
        (
            "compaction encrypted_content compacted again",
            "/v1/responses/compact",
            {"model": MODEL, "input": [a.compaction_item, {"role": "user", "content": "hi"}]},
            {400},
        ),
        (
            "encrypted_content",
            "/v1/responses",
            {**responses, "store": False, "input": [encrypted_only]},
            {400},
        ),
        (
            "encrypted_content before a call output",
            "/v1/responses",
            {**responses, "store": False, "input": [encrypted_only, function_call, call_output]},
            {400},
        ),
        (
            "chat tool_call_id",
            "/v1/chat/completions",
            {"model": MODEL, "messages": chat_replay, "tools": [CHAT_WEATHER]},
            {200},
        ),
        ("messages tool_use id", "/v1/messages", {**anthropic, "messages": messages_replay}, {200}),
        ("messages thinking signature", "/v1/messages", {**anthropic, "messages": signed}, {400}),
        (
            "count_tokens thinking signature",
            "/v1/messages/count_tokens",
            {**anthropic, "messages": signed},
            {400},
        ),
        (
            "approval_request_id not issued to B",
            "/v1/responses",
            {
                "model": MODEL,
                "input": [
                    {"type": "message", "role": "user", "content": "go"},
                    {
                        "type": "mcp_approval_request",
                        "id": "mcpr_" + "0" * 56,
                        "server_label": "docs",
                        "name": "search",
                        "arguments": "{}",
                    },
                    {
                        "type": "mcp_approval_response",
                        "approval_request_id": "mcpr_" + "0" * 56,
                        "approve": True,
                    },
                ],
            },
            {400},
        ),
        (
            "conversation from A's items",
            "/v1/conversations",
            {"items": [{"type": "item_reference", "id": a.item_id}]},
            {200, 400, 404},
        ),
    ]


async def test_b_replays_a_values_in_request_bodies(
    tenants: RunningGateway, tenant_a: TenantA, sim: RunningSim, caplog: pytest.LogCaptureFixture
) -> None:
    seen_by_engine = len(sim.requests)
    with caplog.at_level(logging.DEBUG):
        async with as_tenant(tenants, KEY_B) as b:
            for name, path, body, statuses in _replays(tenant_a):
                r = await b.post(path, json=body)
                assert r.status_code in statuses, (name, r.status_code, r.text)
                assert_nothing_of_a(r)
                if path == "/v1/conversations" and r.status_code == 200:
                    # A reference to A's item resolves to nothing of A's when the conversation is used.
                    conversation = r.json()["id"]
                    assert_nothing_of_a(await b.get(f"/v1/conversations/{conversation}/items"))
                    used = await b.post(
                        "/v1/responses", json={"model": MODEL, "conversation": conversation, "input": "hi"}
                    )
                    assert used.status_code in (200, 400, 404), used.text
                    assert_nothing_of_a(used)
    prompts = [get_encoding().decode(request.input_ids) for request in sim.requests[seen_by_engine:]]
    assert prompts, "the replays that reach the engine were never sent"
    for prompt in prompts:
        assert SECRET not in prompt
        # A's analysis behind its tool calls is never restored into B's prompt.
        assert "<|channel|>analysis<|message|>The user mentioned get_weather" not in prompt
    assert not [record for record in caplog.records if SECRET in record.getMessage()]
    async with as_tenant(tenants, KEY_B) as b:
        metrics = await b.get("/metrics")
    assert SECRET not in metrics.text


@pytest.mark.parametrize("operation", [op for op, kind in ROUTES.items() if kind == "open"], ids=str)
async def test_routes_without_tenant_state_show_b_nothing_of_a(
    tenants: RunningGateway, tenant_a: TenantA, operation: tuple[str, str]
) -> None:
    method, path = operation
    bodies: dict[str, Any] = {
        "/v1/harmony/parse": {"token_ids": [200006, 173781, 200005, 17196, 200008, 3030, 200002]},
        "/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 4}},
        "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 4},
    }
    url = path.format(model_id=MODEL.replace("/", "%2F"), name="playground.js")
    async with as_tenant(tenants, KEY_B) as b:
        r = await b.request(method.upper(), url, json=bodies.get(path) if method == "post" else None)
    assert r.status_code in (200, 404), r.text
    assert_nothing_of_a(r)
    assert tenant_a.response_id not in r.text and tenant_a.conversation_id not in r.text


@pytest.mark.parametrize("operation", [op for op, kind in ROUTES.items() if kind == "admin"], ids=str)
async def test_a_tenant_key_never_opens_the_admin_plane(
    tenants: RunningGateway, operation: tuple[str, str]
) -> None:
    method, path = operation
    async with as_tenant(tenants, KEY_B) as b:
        r = await b.request(method.upper(), path.format(worker_id="w0"), json={"url": "grpc://127.0.0.1:1"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


async def test_b_cannot_cancel_or_stream_a_background_response(
    tenants: RunningGateway, sim: RunningSim
) -> None:
    async with as_tenant(tenants, KEY_A) as a, as_tenant(tenants, KEY_B) as b:
        started = await _ok(
            await a.post(
                "/v1/responses", json={"model": MODEL, "input": f"[[long]] {SECRET}", "background": True}
            )
        )
        try:
            for method, path in (
                ("POST", f"/v1/responses/{started['id']}/cancel"),
                ("GET", f"/v1/responses/{started['id']}?stream=true"),
                ("GET", f"/v1/responses/{started['id']}"),
            ):
                r = await b.request(method, path)
                assert r.status_code == 404, r.text
                assert_nothing_of_a(r)
        finally:
            await a.post(f"/v1/responses/{started['id']}/cancel")
        await wait_until(lambda: sim.active_requests == 0, timeout=15)
        finished = await _ok(await a.get(f"/v1/responses/{started['id']}"))
        assert finished["status"] == "cancelled"


async def test_keys_of_one_tenant_share_what_they_store(sim: RunningSim, tmp_path: Any) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-ops-1 tenant=ops\nsk-ops-2 tenant=ops\nsk-solo\n")
    policies = read_key_file(str(key_file))
    settings = test_settings(worker_urls=(sim.url,), api_keys=frozenset(policies), key_policies=policies)
    async with running_gateway(settings) as gw:
        async with as_tenant(gw, "sk-ops-1") as ops1, as_tenant(gw, "sk-ops-2") as ops2:
            stored = await _ok(await ops1.post("/v1/responses", json={"model": MODEL, "input": SECRET}))
            again = await _ok(await ops2.get(f"/v1/responses/{stored['id']}"))
            assert again["id"] == stored["id"]
        async with as_tenant(gw, "sk-solo") as solo:
            assert (await solo.get(f"/v1/responses/{stored['id']}")).status_code == 404
