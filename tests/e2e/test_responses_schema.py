"""Every Response body and stream event, as sent over real HTTP by the gateway in front of the sim engine,
is valid against the published schemas (OpenAI's OpenAPI document and Open Responses; see
tests/support/published_schemas.py): JSON bodies, `GET`, each streamed snapshot, background responses
(queued, in progress, completed, cancelled, replayed), stored chains, function tools, reasoning, MCP
and built-in tool items, incomplete and failed responses, and the Conversations objects. The official
SDK decodes the same bodies and streams."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import openai
import pytest

from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from harmony_gateway.storage.base import StoredResponse
from tests.conftest import MODEL
from tests.mcp.servers import RunningMcp, build_browser_server, serve_mcp, write_tools_config
from tests.support.published_schemas import (
    assert_valid,
    assert_valid_event,
    assert_valid_response,
    event_problems,
)
from tests.support.responses_stream import validate_event_stream
from tests.support.servers import RunningGateway, running_gateway, test_settings, wait_until

WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}},
        "required": ["location"],
    },
}
#: A function tool as clients often send it: no description, no parameters, no strict.
BARE: dict[str, Any] = {"type": "function", "name": "ping"}


async def sse(http: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> list[dict[str, Any]]:
    """The events of an SSE response as sent, each checked against the schemas by the stream validator."""
    events = []
    async with http.stream(method, url, **kwargs) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


async def stream(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = await sse(http, "POST", "/responses", json={**body, "stream": True})
    validate_event_stream(events)
    return events


async def post(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    r = await http.post("/responses", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    assert_valid_response(out)
    return out


async def get(http: httpx.AsyncClient, response_id: str) -> dict[str, Any]:
    r = await http.get(f"/responses/{response_id}")
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    assert_valid_response(out)
    return out


@pytest.fixture
async def http(gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as c:
        yield c


async def test_a_json_body_its_get_and_its_input_items(http: httpx.AsyncClient, sim: RunningSim) -> None:
    body = {
        "model": MODEL,
        "input": "What is 2+2?",
        "user": "user-1",
        "safety_identifier": "hashed-user-1",
        "prompt_cache_key": "tenant-a:chat-7",
        "presence_penalty": 0.5,
        "top_logprobs": 2,
        "metadata": {"k": "v"},
    }
    r = await post(http, body)
    assert r["status"] == "completed" and isinstance(r["completed_at"], int)
    assert [i["type"] for i in r["output"]] == ["reasoning", "message"]
    # Echoed as sent, or as applied when the request left them out.
    assert r["safety_identifier"] == "hashed-user-1" and r["prompt_cache_key"] == "tenant-a:chat-7"
    assert r["presence_penalty"] == 0.5 and r["frequency_penalty"] == 0.0
    assert sim.requests[-1].sampling["presence_penalty"] == 0.5  # echoed as the engine was asked
    assert r["top_logprobs"] == 2 and r["service_tier"] == "default" and r["user"] == "user-1"
    assert r["usage"]["total_tokens"] > 0
    fetched = await get(http, r["id"])
    assert fetched == r
    items = await http.get(f"/responses/{r['id']}/input_items")
    assert_valid("ResponseItemList", items.json())
    # Left out: null where the schema allows it, the default otherwise; `user` is absent, never null.
    plain = await post(http, {"model": MODEL, "input": "hi"})
    assert plain["safety_identifier"] is None and plain["prompt_cache_key"] is None
    assert plain["top_logprobs"] == 0 and "user" not in plain
    assert (await http.delete(f"/responses/{r['id']}")).status_code == 200


async def test_every_event_of_a_text_stream_with_reasoning(http: httpx.AsyncClient) -> None:
    events = await stream(
        http,
        {"model": MODEL, "input": "Tell me something", "include": ["reasoning.encrypted_content"]},
    )
    created, in_progress, completed = events[0], events[1], events[-1]
    for snapshot in (created, in_progress):
        assert "completed_at" in snapshot["response"] and snapshot["response"]["completed_at"] is None
        assert snapshot["response"]["usage"]["total_tokens"] == 0  # nothing counted yet
    assert completed["type"] == "response.completed"
    reasoning = completed["response"]["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"]
    assert {e["type"] for e in events} >= {
        "response.reasoning_text.delta",  # OpenAI's name (Open Responses says response.reasoning.delta)
        "response.reasoning_text.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.added",
        "response.content_part.done",
    }
    assert (await get(http, completed["response"]["id"]))["output"] == completed["response"]["output"]


async def test_logprobs_in_bodies_and_events(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "input": "logprobs please", "include": ["message.output_text.logprobs"]}
    r = await post(http, {**body, "top_logprobs": 3})
    assert r["output"][-1]["content"][0]["logprobs"]
    events = await stream(http, {**body, "top_logprobs": 3})
    assert any(e.get("logprobs") for e in events if e["type"] == "response.output_text.delta")


async def test_function_tools_are_echoed_whole_and_their_calls_continue(http: httpx.AsyncClient) -> None:
    tools = [WEATHER, BARE, {**BARE, "name": "pong", "strict": True}]
    body = {"model": MODEL, "input": "What is the weather in Paris? use get_weather", "tools": tools}
    r = await post(http, body)
    echoed = r["tools"]
    assert echoed[0] == {**WEATHER, "strict": None}
    assert echoed[1] == {**BARE, "description": None, "parameters": None, "strict": None}
    assert echoed[2]["strict"] is True
    call = r["output"][-1]
    assert call["type"] == "function_call" and call["status"] == "completed"
    events = await stream(http, body)
    assert "response.function_call_arguments.done" in [e["type"] for e in events]
    follow = {
        "model": MODEL,
        "previous_response_id": r["id"],
        "tools": tools,
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}],
    }
    second = await post(http, follow)
    assert second["previous_response_id"] == r["id"] and "Sunny" in second["output"][-1]["content"][0]["text"]
    await get(http, second["id"])
    items = await http.get(f"/responses/{second['id']}/input_items")
    assert_valid("ResponseItemList", items.json())
    events = await stream(http, {**follow, "tool_choice": "none"})
    assert events[-1]["response"]["tool_choice"] == "none"


async def test_input_items_as_listed(http: httpx.AsyncClient) -> None:
    """Input items are stored and listed as the item resources of the schema, whatever shape the client
    sent them in (an answer sent back without its annotations, a call output without a status)."""
    r = await post(
        http,
        {
            "model": MODEL,
            "tools": [WEATHER],
            "input": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "input_text", "text": "No jokes."}]},
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
                {"role": "assistant", "content": "It is sunny."},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Anything else?"}]},
                {"role": "user", "content": "No, thanks."},
            ],
        },
    )
    listing = (await http.get(f"/responses/{r['id']}/input_items")).json()
    assert len(listing["data"]) == 8
    assert_valid("ResponseItemList", listing)
    # A reference is listed as the item it points at.
    answer = r["output"][-1]
    follow = await post(
        http,
        {
            "model": MODEL,
            "previous_response_id": r["id"],
            "input": [{"type": "item_reference", "id": answer["id"]}, {"role": "user", "content": "Again?"}],
        },
    )
    listing = (await http.get(f"/responses/{follow['id']}/input_items")).json()
    assert_valid("ResponseItemList", listing)
    assert answer in listing["data"]


async def test_incomplete_by_max_output_tokens(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "input": "[[long]] think at length", "max_output_tokens": 16}
    r = await post(http, body)
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["completed_at"] is None
    events = await stream(http, body)
    assert events[-1]["type"] == "response.incomplete"
    await get(http, r["id"])


async def test_a_failed_stream_and_its_stored_response(http: httpx.AsyncClient, sim: RunningSim) -> None:
    sim.fail_next(grpc.StatusCode.INTERNAL, after_tokens=3, message="engine crashed")
    events = await stream(http, {"model": MODEL, "input": "crash please"})
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["error"]["code"] == "server_error"
    usage = failed["response"]["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0  # what the failed generation used
    stored = await get(http, failed["response"]["id"])
    assert stored["status"] == "failed"


async def test_a_background_response_queued_running_completed_and_replayed(
    http: httpx.AsyncClient, gateway: RunningGateway
) -> None:
    queued = await post(http, {"model": MODEL, "input": "poll me", "background": True})
    assert queued["status"] == "queued" and queued["completed_at"] is None and queued["background"] is True
    await wait_until(lambda: not gateway.state.background.running(queued["id"]), timeout=10)
    done = await get(http, queued["id"])
    assert done["status"] == "completed"
    events = await sse(http, "GET", f"/responses/{queued['id']}", params={"stream": "true"})
    validate_event_stream(events)
    assert events[0]["response"]["status"] == "queued"
    tail = await sse(
        http, "GET", f"/responses/{queued['id']}", params={"stream": "true", "starting_after": "4"}
    )
    assert tail and tail[0]["sequence_number"] == 5 and tail == events[5:]
    for event in tail:
        assert_valid_event(event)
    live = await stream(http, {"model": MODEL, "input": "stream me", "background": True})
    assert live[0]["response"]["status"] == "queued" and live[1]["response"]["status"] == "in_progress"


@pytest.fixture(scope="module")
async def slow_sim() -> AsyncIterator[RunningSim]:
    async with await start_sim_engine(SimConfig(model=MODEL, tokens_per_second=200)) as engine:
        yield engine


@pytest.fixture(scope="module")
async def slow_gateway(slow_sim: RunningSim) -> AsyncIterator[RunningGateway]:
    async with running_gateway(test_settings(worker_urls=(slow_sim.url,))) as gw:
        yield gw


async def test_a_cancelled_background_response(slow_gateway: RunningGateway, slow_sim: RunningSim) -> None:
    async with httpx.AsyncClient(base_url=slow_gateway.base_url, timeout=30) as http:
        body = {"model": MODEL, "input": "[[long]] a long one", "background": True}
        before = len(slow_sim.requests)
        r = await post(http, body)
        await wait_until(lambda: len(slow_sim.requests) > before)  # generating
        running = await get(http, r["id"])
        assert running["status"] in ("queued", "in_progress")
        cancelled = await http.post(f"/responses/{r['id']}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert_valid_response(cancelled.json())
        await wait_until(lambda: not slow_gateway.state.background.running(r["id"]), timeout=10)
        stored = await get(http, r["id"])
        assert stored["status"] == "cancelled" and stored["completed_at"] is None
        events = await sse(http, "GET", f"/responses/{r['id']}", params={"stream": "true"})
        validate_event_stream(events)
        assert events[-1]["response"]["status"] == "cancelled"


async def test_a_response_stored_by_an_earlier_version_is_completed_when_read(
    http: httpx.AsyncClient, gateway: RunningGateway
) -> None:
    """Stored bodies and event logs outlive upgrades: one written before these fields existed is sent
    with them."""
    legacy = await post(http, {"model": MODEL, "input": "old", "tools": [BARE], "user": "u"})
    for key in ("completed_at", "presence_penalty", "frequency_penalty", "service_tier"):
        del legacy[key]
    for key in ("safety_identifier", "prompt_cache_key"):
        del legacy[key]
    legacy.update(id="resp_legacy", top_logprobs=None, user=None, tools=[BARE])
    store = gateway.state.store
    record = StoredResponse(
        id="resp_legacy",
        owner="",
        created_at=legacy["created_at"],
        updated_at=legacy["created_at"],
        status="completed",
        model=legacy["model"],
        response=legacy,
        input_items=[],
        history=[],
        background=True,
    )
    await store.put_response(record)
    await store.append_events(
        "resp_legacy",
        [
            {"type": "response.created", "sequence_number": 0, "response": {**legacy, "status": "queued"}},
            {"type": "response.completed", "sequence_number": 1, "response": legacy},
        ],
    )
    assert event_problems({"type": "response.completed", "sequence_number": 1, "response": legacy})
    fetched = await get(http, "resp_legacy")
    assert fetched["completed_at"] is None and fetched["tools"][0]["strict"] is None
    events = await sse(http, "GET", "/responses/resp_legacy", params={"stream": "true"})
    for event in events:
        assert_valid_event(event)


async def test_conversation_objects(http: httpx.AsyncClient) -> None:
    created = await http.post(
        "/conversations", json={"items": [{"role": "user", "content": "hello"}], "metadata": {"a": "b"}}
    )
    conversation = created.json()
    assert_valid("ConversationResource", conversation)
    cid = conversation["id"]
    assert_valid("ConversationResource", (await http.get(f"/conversations/{cid}")).json())
    updated = await http.post(f"/conversations/{cid}", json={"metadata": {"a": "c"}})
    assert_valid("ConversationResource", updated.json())
    r = await post(http, {"model": MODEL, "input": "and now?", "conversation": cid})
    assert r["conversation"] == {"id": cid}
    listing = (await http.get(f"/conversations/{cid}/items")).json()
    assert_valid("ConversationItemList", listing)
    assert {item["type"] for item in listing["data"]} >= {"message", "reasoning"}
    added = await http.post(
        f"/conversations/{cid}/items", json={"items": [{"role": "user", "content": "more"}]}
    )
    assert_valid("ConversationItemList", added.json())
    item_id = added.json()["data"][0]["id"]
    assert_valid("ConversationItem", (await http.get(f"/conversations/{cid}/items/{item_id}")).json())
    for item in listing["data"]:
        assert_valid("ConversationItem", item)
    refused = await http.post(
        f"/conversations/{cid}/items", json={"items": [{"type": "item_reference", "id": item_id}]}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "items[0].type"
    deleted_item = await http.delete(f"/conversations/{cid}/items/{item_id}")
    assert_valid("ConversationResource", deleted_item.json())
    deleted = await http.delete(f"/conversations/{cid}")
    assert_valid("DeletedConversationResource", deleted.json())


async def test_the_sdk_decodes_what_the_schemas_accept(client: openai.AsyncOpenAI) -> None:
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input="sdk round trip", tools=[WEATHER], safety_identifier="sid"
    )
    assert_valid_response(raw.http_response.json())
    parsed = raw.parse()
    assert parsed.safety_identifier == "sid" and parsed.tools[0].strict is None
    retrieved = await client.responses.with_raw_response.retrieve(parsed.id)
    assert_valid_response(retrieved.http_response.json())
    assert retrieved.parse().output_text == parsed.output_text
    events = []
    async with client.responses.stream(model=MODEL, input="sdk stream", tools=[WEATHER]) as s:
        async for event in s:
            events.append(event.model_dump(exclude_unset=True, warnings=False))
        final = await s.get_final_response()
    validate_event_stream(events)
    assert final.completed_at is not None and final.service_tier == "default"
    background = await client.responses.create(model=MODEL, input="sdk background", background=True)
    assert background.status == "queued" and background.completed_at is None
    replay = [
        e.model_dump(exclude_unset=True, warnings=False)
        async for e in await client.responses.retrieve(background.id, stream=True)
    ]
    validate_event_stream(replay)


# -- gateway-executed tools ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[RunningMcp]:
    async with serve_mcp(build_browser_server([])) as running:
        yield running


@pytest.fixture(scope="module")
async def tools_gateway(
    sim: RunningSim, browser: RunningMcp, tmp_path_factory
) -> AsyncIterator[RunningGateway]:
    config = write_tools_config(tmp_path_factory.mktemp("mcp"), browser.url)
    settings = test_settings(worker_urls=(sim.url,), mcp_allow_hosts=("127.0.0.1",), mcp_config=str(config))
    async with running_gateway(settings) as gw:
        yield gw


@pytest.fixture
async def tools_http(tools_gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=tools_gateway.base_url, timeout=30) as c:
        yield c


def docs_tool(docs: RunningMcp, **extra: Any) -> dict[str, Any]:
    return {
        "type": "mcp",
        "server_label": "docs",
        "server_url": docs.url,
        "require_approval": "never",
        **extra,
    }


async def test_mcp_items_and_events(tools_http: httpx.AsyncClient, docs: RunningMcp) -> None:
    body = {"model": MODEL, "input": "Please search_docs for harmony", "tools": [docs_tool(docs)]}
    r = await post(tools_http, body)
    assert [i["type"] for i in r["output"]] == [
        "mcp_list_tools",
        "reasoning",
        "mcp_call",
        "reasoning",
        "message",
    ]
    events = await stream(tools_http, body)
    assert "response.mcp_call.completed" in [e["type"] for e in events]
    failing = await post(tools_http, {**body, "input": "Please explode the docs"})
    assert any(i["type"] == "mcp_call" and i["error"] for i in failing["output"])
    await stream(tools_http, {**body, "input": "Please explode the docs"})
    gated = {**body, "tools": [docs_tool(docs, require_approval="always")]}
    asked = await post(tools_http, gated)
    request = asked["output"][-1]
    assert request["type"] == "mcp_approval_request"
    approval = {"type": "mcp_approval_response", "approval_request_id": request["id"], "approve": True}
    events = await stream(tools_http, {**gated, "previous_response_id": asked["id"], "input": [approval]})
    assert events[-1]["response"]["output"][0]["approval_request_id"] == request["id"]
    items = await tools_http.get(f"/responses/{events[-1]['response']['id']}/input_items")
    assert_valid("ResponseItemList", items.json())


async def test_builtin_tool_items_and_events(tools_http: httpx.AsyncClient) -> None:
    search = {
        "model": MODEL,
        "input": "Please search for gpt-oss releases",
        "tools": [{"type": "web_search_preview"}],
    }
    r = await post(tools_http, search)
    assert "web_search_call" in [i["type"] for i in r["output"]]
    await stream(tools_http, search)
    code = {"model": MODEL, "input": "Use python for hello", "tools": [{"type": "code_interpreter"}]}
    r = await post(tools_http, code)
    assert r["tools"][0]["container"] == {"type": "auto"}  # required by the schema; the gateway's own
    assert "code_interpreter_call" in [i["type"] for i in r["output"]]
    await stream(tools_http, code)


async def test_client_tool_kinds(http: httpx.AsyncClient) -> None:
    custom = {"type": "custom", "name": "apply_patch", "description": "Edit files."}
    r = await post(http, {"model": MODEL, "input": "Use apply_patch for main.py", "tools": [custom]})
    assert r["output"][-1]["type"] == "custom_tool_call"
    await stream(http, {"model": MODEL, "input": "Use apply_patch for main.py", "tools": [custom]})
    shell = {"model": MODEL, "input": "Use local_shell for ls", "tools": [{"type": "local_shell"}]}
    r = await post(http, shell)
    assert r["output"][-1]["type"] == "local_shell_call"
    await stream(http, shell)
    namespace = {
        "type": "namespace",
        "name": "crm",
        "description": "Customer records",
        "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}],
    }
    r = await post(http, {"model": MODEL, "input": "Use lookup for bob", "tools": [namespace]})
    assert r["tools"][0]["tools"][0]["strict"] is None
    await stream(http, {"model": MODEL, "input": "Use lookup for bob", "tools": [namespace]})
