"""The Responses MCP tool loop end to end: official SDK → gateway (real HTTP) → sim engine (real gRPC), with
real MCP servers (streamable HTTP on loopback, stdio subprocess) executing the tools."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import openai
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from tests.conftest import MODEL
from tests.mcp.servers import (
    RunningMcp,
    build_browser_server,
    build_docs_server,
    serve_mcp,
    write_tools_config,
)
from tests.support.responses_stream import validate_event_stream
from tests.support.servers import (
    RunningGateway,
    client_request_id,
    running_gateway,
    test_settings,
    wait_until,
)

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}},
        "required": ["location"],
    },
}


@pytest.fixture(scope="module")
async def browser_calls() -> list[tuple[str, dict[str, Any]]]:
    return []


@pytest.fixture(scope="module")
async def browser(browser_calls) -> AsyncIterator[RunningMcp]:
    async with serve_mcp(build_browser_server(browser_calls)) as running:
        yield running


@pytest.fixture(scope="module")
async def mcp_gateway(sim, browser, tmp_path_factory) -> AsyncIterator[RunningGateway]:
    """Allows 127.0.0.1; configures `local` (stdio, also backing python) and `web` (HTTP, backing browser)."""
    config = write_tools_config(tmp_path_factory.mktemp("mcp"), browser.url)
    settings = test_settings(
        worker_urls=(sim.url,),
        mcp_allow_hosts=("127.0.0.1",),
        mcp_tool_timeout=0.5,
        mcp_config=str(config),
    )
    async with running_gateway(settings) as gw:
        yield gw


@pytest.fixture(scope="module")
async def strict_gateway(sim) -> AsyncIterator[RunningGateway]:
    """No --mcp-allow-hosts and no MCP config; hosted tools without a backing are refused."""
    async with running_gateway(test_settings(worker_urls=(sim.url,), unbacked_tools="reject")) as gw:
        yield gw


@pytest.fixture
async def mc(mcp_gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=mcp_gateway.base_url, api_key="k", max_retries=0, timeout=30) as c:
        yield c


def docs_tool(docs: RunningMcp, **extra: Any) -> dict[str, Any]:
    return {
        "type": "mcp",
        "server_label": "docs",
        "server_url": docs.url,
        "require_approval": "never",
        **extra,
    }


def prompt_of(request: Any) -> str:
    return get_encoding().decode(request.input_ids)


def kinds(response: Any) -> list[str]:
    return [item.type for item in response.output]


async def collect(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[list[Any], Any]:
    events = []
    async with client.responses.stream(**kwargs) as stream:
        async for event in stream:
            events.append(event)
        final = await stream.get_final_response()
    validate_event_stream([e.model_dump(exclude_unset=True, warnings=False) for e in events])
    return events, final


async def raw_stream(gateway: RunningGateway, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Events decoded from the raw SSE body (for streams the SDK helper refuses: response.incomplete)."""
    import json

    events = []
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", gateway.base_url + "/responses", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
    validate_event_stream(events)
    return events


async def test_single_call_to_final_answer(mc, sim, docs, docs_calls) -> None:
    before = len(sim.requests)
    r = await mc.responses.create(
        model=MODEL, input="Please search_docs for harmony", tools=[docs_tool(docs)]
    )
    assert r.status == "completed"
    assert kinds(r) == ["mcp_list_tools", "reasoning", "mcp_call", "reasoning", "message"]
    listing = r.output[0]
    assert listing.server_label == "docs" and listing.id.startswith("mcpl_")
    assert {t.name for t in listing.tools} == {"search_docs", "lookup_user", "explode", "slow_tool"}
    assert all(t.input_schema for t in listing.tools)
    call = r.output[2]
    assert call.id.startswith("mcp_") and call.server_label == "docs" and call.name == "search_docs"
    assert call.arguments == '{"query":"harmony"}'
    assert call.output == "Docs result for harmony: the answer is 42." and call.error is None
    assert call.status == "completed"
    assert ("search_docs", {"query": "harmony"}) in docs_calls
    assert "Docs result for harmony" in r.output_text
    engine = sim.requests[before:]
    assert len(engine) == 2
    # Each generation is its own engine request: engines key a request's state, clean-up and Abort by
    # its id, and clean up after the call ended, so a reused id could be cut by its predecessor's.
    first_id, second_id = (e.request_id for e in engine)
    assert first_id != second_id and client_request_id(first_id) == client_request_id(second_id)
    first, second = prompt_of(engine[0]), prompt_of(engine[1])
    assert "namespace docs {" in first and "type search_docs" in first
    assert "to=docs.search_docs" in second
    assert (
        "<|start|>docs.search_docs to=assistant<|channel|>commentary<|message|>Docs result for harmony"
        in second
    )
    # usage sums both iterations
    assert r.usage.input_tokens == len(engine[0].input_ids) + len(engine[1].input_ids)
    assert r.usage.output_tokens > 0 and r.usage.output_tokens_details.reasoning_tokens > 0
    stored = await mc.responses.retrieve(r.id)
    assert [i.id for i in stored.output] == [i.id for i in r.output]


async def test_stream_matches_non_stream_and_parses(mc, docs) -> None:
    body = {"model": MODEL, "input": "Please search_docs for streams", "tools": [docs_tool(docs)]}
    events, final = await collect(mc, **body)
    plain = await mc.responses.create(**body)
    types = [e.type for e in events]
    for expected in (
        "response.mcp_list_tools.in_progress",
        "response.mcp_list_tools.completed",
        "response.mcp_call.in_progress",
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done",
        "response.mcp_call.completed",
    ):
        assert expected in types
    assert types.count("response.created") == 1 and types[-1] == "response.completed"
    assert kinds(final) == kinds(plain)
    assert [e.item.id for e in events if e.type == "response.output_item.added"] == [
        i.id for i in final.output
    ]
    args = "".join(e.delta for e in events if e.type == "response.mcp_call_arguments.delta")
    assert args == final.output[2].arguments == plain.output[2].arguments
    assert final.output[2].output == plain.output[2].output
    assert final.output_text == plain.output_text
    done = [e for e in events if e.type == "response.output_item.done" and e.item.type == "mcp_call"]
    assert done[0].item.output.startswith("Docs result for streams")


async def test_two_tools_in_sequence(mc, sim, docs) -> None:
    r = await mc.responses.create(
        model=MODEL, input="[[sequence]] search_docs and then lookup_user for alice", tools=[docs_tool(docs)]
    )
    calls = [i for i in r.output if i.type == "mcp_call"]
    assert [c.name for c in calls] == ["search_docs", "lookup_user"]
    assert calls[1].output == "User alice is an administrator."
    assert kinds(r)[-1] == "message" and "User alice is an administrator" in r.output_text
    last = prompt_of(sim.requests[-1])
    assert "Docs result for alice" in last and "User alice is an administrator" in last


async def test_tool_error_reaches_the_model(mc, sim, docs) -> None:
    r = await mc.responses.create(model=MODEL, input="Call explode for testing", tools=[docs_tool(docs)])
    call = next(i for i in r.output if i.type == "mcp_call")
    assert call.status == "failed" and call.output is None
    assert call.error.type == "mcp_tool_execution_error"
    assert "explosion while handling testing" in call.error.content[0]["text"]
    assert r.status == "completed" and "explosion" in r.output_text
    assert "Error: " in prompt_of(sim.requests[-1])


async def test_slow_tool_times_out(mc, docs) -> None:
    events, final = await collect(mc, model=MODEL, input="Use slow_tool for coffee", tools=[docs_tool(docs)])
    call = next(i for i in final.output if i.type == "mcp_call")
    assert call.status == "failed" and call.error.type == "http_error" and call.error.code == 504
    assert "timed out after 0.5 s" in call.error.message
    assert "response.mcp_call.failed" in [e.type for e in events]
    assert final.status == "completed" and "timed out" in final.output_text


async def test_invalid_json_arguments_ask_for_valid_json(mc, sim, docs, docs_calls) -> None:
    count = len(docs_calls)
    r = await mc.responses.create(
        model=MODEL, input="[[bad_json]] search_docs for x", tools=[docs_tool(docs)]
    )
    call = next(i for i in r.output if i.type == "mcp_call")
    assert call.status == "failed" and call.error.type == "mcp_protocol_error"
    assert call.error.message.startswith("invalid JSON arguments")
    assert len(docs_calls) == count  # never sent to the server
    assert "not valid JSON" in prompt_of(sim.requests[-1])


async def test_max_tool_calls_then_answer(mc, sim, docs) -> None:
    r = await mc.responses.create(
        model=MODEL, input="[[repeat]] search_docs for loops", tools=[docs_tool(docs)], max_tool_calls=2
    )
    assert r.status == "completed" and r.max_tool_calls == 2
    assert [i.type for i in r.output].count("mcp_call") == 2
    assert kinds(r)[-1] == "message"
    assert "max_tool_calls" in prompt_of(sim.requests[-1])


async def test_max_tool_calls_ignored_ends_incomplete(mcp_gateway, mc, docs) -> None:
    body = {
        "model": MODEL,
        "input": "[[stubborn]] search_docs for loops",
        "tools": [docs_tool(docs)],
        "max_tool_calls": 1,
    }
    r = await mc.responses.create(**body)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in r.output].count("mcp_call") == 1
    events = await raw_stream(mcp_gateway, body)
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in final["output"]] == [i.type for i in r.output]


async def test_allowed_tools_filter(mc, sim, docs) -> None:
    r = await mc.responses.create(
        model=MODEL,
        input="Please search_docs for filters",
        tools=[docs_tool(docs, allowed_tools=["lookup_user"])],
    )
    assert [t.name for t in r.output[0].tools] == ["lookup_user"]
    assert "mcp_call" not in kinds(r)  # search_docs is not offered, so the model cannot call it
    prompt = prompt_of(sim.requests[-1])
    assert "type lookup_user" in prompt and "search_docs =" not in prompt
    r2 = await mc.responses.create(
        model=MODEL,
        input="lookup_user for bob",
        tools=[docs_tool(docs, allowed_tools={"tool_names": ["lookup_user"]})],
    )
    assert next(i for i in r2.output if i.type == "mcp_call").output == "User bob is an administrator."


async def test_approval_round_trip_approved(mc, sim, docs, docs_calls) -> None:
    tool = docs_tool(docs, require_approval="always")
    r1 = await mc.responses.create(model=MODEL, input="Please search_docs for secrets", tools=[tool])
    assert r1.status == "completed"
    assert kinds(r1) == ["mcp_list_tools", "reasoning", "mcp_approval_request"]
    request = r1.output[-1]
    assert request.id.startswith("mcpr_") and request.name == "search_docs" and request.server_label == "docs"
    assert request.arguments == '{"query":"secrets"}'
    assert ("search_docs", {"query": "secrets"}) not in docs_calls
    events, r2 = await collect(
        mc,
        model=MODEL,
        previous_response_id=r1.id,
        tools=[tool],
        input=[{"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}],
    )
    assert kinds(r2) == ["mcp_call", "reasoning", "message"]  # listed once per chain (smg#1163)
    call = r2.output[0]
    assert call.approval_request_id == request.id and call.output.startswith("Docs result for secrets")
    assert ("search_docs", {"query": "secrets"}) in docs_calls
    assert "Docs result for secrets" in r2.output_text
    assert "response.mcp_list_tools.in_progress" not in [e.type for e in events]
    with pytest.raises(openai.BadRequestError) as info:
        await mc.responses.create(
            model=MODEL,
            previous_response_id=r2.id,
            tools=[tool],
            input=[{"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}],
        )
    assert info.value.param == "input[0].approval_request_id"


async def test_approval_denied(mc, sim, docs, docs_calls) -> None:
    tool = docs_tool(docs, require_approval={"never": {"tool_names": ["lookup_user"]}})
    r1 = await mc.responses.create(model=MODEL, input="Please search_docs for denial", tools=[tool])
    request = r1.output[-1]
    assert request.type == "mcp_approval_request"
    r2 = await mc.responses.create(
        model=MODEL,
        previous_response_id=r1.id,
        tools=[tool],
        input=[
            {
                "type": "mcp_approval_response",
                "approval_request_id": request.id,
                "approve": False,
                "reason": "not today",
            }
        ],
    )
    assert "mcp_call" not in kinds(r2) and kinds(r2)[-1] == "message"
    assert ("search_docs", {"query": "denial"}) not in docs_calls
    prompt = prompt_of(sim.requests[-1])
    assert "The user declined to run this tool call" in prompt and "not today" in prompt
    # lookup_user is exempt: it runs without asking
    r3 = await mc.responses.create(model=MODEL, input="lookup_user for carol", tools=[tool])
    assert "mcp_call" in kinds(r3) and "mcp_approval_request" not in kinds(r3)


async def test_unknown_approval_request_is_400(mc, docs) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await mc.responses.create(
            model=MODEL,
            tools=[docs_tool(docs)],
            input=[{"type": "mcp_approval_response", "approval_request_id": "mcpr_nope", "approve": True}],
        )
    assert info.value.param == "input[0].approval_request_id"


async def test_mixed_mcp_and_function_tools(mc, sim, docs) -> None:
    tools = [docs_tool(docs), WEATHER_TOOL]
    r1 = await mc.responses.create(
        model=MODEL, input="[[sequence]] search_docs then get_weather in Paris", tools=tools
    )
    assert [k for k in kinds(r1) if k != "reasoning"] == ["mcp_list_tools", "mcp_call", "function_call"]
    call = r1.output[-1]
    assert call.name == "get_weather" and call.arguments == '{"location":"Paris"}'
    r2 = await mc.responses.create(
        model=MODEL,
        previous_response_id=r1.id,
        tools=tools,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Rainy, 12 C"}],
    )
    assert r2.status == "completed" and "Rainy, 12 C" in r2.output_text
    assert "mcp_list_tools" not in kinds(r2)
    prompt = prompt_of(sim.requests[-1])
    assert "Docs result for Paris" in prompt and "to=functions.get_weather" in prompt


async def test_chain_replays_mcp_history(mc, sim, docs) -> None:
    r1 = await mc.responses.create(
        model=MODEL, input="Please search_docs for chains", tools=[docs_tool(docs)]
    )
    r2 = await mc.responses.create(
        model=MODEL, previous_response_id=r1.id, input="thanks, that helps", tools=[docs_tool(docs)]
    )
    assert kinds(r2) == ["reasoning", "message"]
    prompt = prompt_of(sim.requests[-1])
    assert "to=docs.search_docs" in prompt and "Docs result for chains" in prompt
    # a chain continued without the MCP tool still replays the stored call and result
    r3 = await mc.responses.create(model=MODEL, previous_response_id=r2.id, input="and again")
    assert r3.status == "completed" and "Docs result for chains" in prompt_of(sim.requests[-1])


async def test_conversation_replays_mcp_items(mc, sim, docs) -> None:
    conv = await mc.conversations.create()
    await mc.responses.create(
        model=MODEL,
        input="Please search_docs for conversations",
        tools=[docs_tool(docs)],
        conversation=conv.id,
    )
    items = await mc.conversations.items.list(conv.id, order="asc")
    assert "mcp_call" in [i.type for i in items.data] and "mcp_list_tools" in [i.type for i in items.data]
    r2 = await mc.responses.create(
        model=MODEL, input="what did it say?", tools=[docs_tool(docs)], conversation=conv.id
    )
    assert "mcp_list_tools" not in kinds(r2)
    prompt = prompt_of(sim.requests[-1])
    assert "to=docs.search_docs" in prompt
    assert (
        "<|start|>docs.search_docs to=assistant<|channel|>commentary<|message|>Docs result for conversations"
        in prompt
    )


async def test_configured_stdio_server(mc, sim) -> None:
    r = await mc.responses.create(
        model=MODEL,
        input="What is the local_time in Lisbon?",
        tools=[{"type": "mcp", "server_label": "local"}],
    )
    call = next(i for i in r.output if i.type == "mcp_call")
    assert call.server_label == "local" and call.output == "It is 12:00 in Lisbon."
    assert "It is 12:00 in Lisbon" in r.output_text


async def test_builtin_web_search(mc, sim, browser_calls) -> None:
    events, final = await collect(
        mc, model=MODEL, input="Please search for gpt-oss releases", tools=[{"type": "web_search_preview"}]
    )
    assert kinds(final) == ["reasoning", "web_search_call", "reasoning", "message"]
    call = final.output[1]
    assert call.id.startswith("ws_") and call.status == "completed"
    assert call.action.type == "search" and call.action.query == "gpt-oss"
    assert ("search", {"query": "gpt-oss", "topn": 1}) in browser_calls
    types = [e.type for e in events]
    for expected in (
        "response.web_search_call.in_progress",
        "response.web_search_call.searching",
        "response.web_search_call.completed",
    ):
        assert expected in types
    first, second = prompt_of(sim.requests[-2]), prompt_of(sim.requests[-1])
    assert "## browser" in first and "namespace browser {" in first
    assert "assistant to=browser.search<|channel|>analysis" in second
    assert (
        "<|start|>browser.search to=assistant<|channel|>analysis<|message|>[0] Result for gpt-oss" in second
    )


async def test_builtin_code_interpreter(mc, sim) -> None:
    events, final = await collect(
        mc,
        model=MODEL,
        input="Use python for hello",
        tools=[{"type": "code_interpreter", "container": {"type": "auto"}}],
    )
    call = next(i for i in final.output if i.type == "code_interpreter_call")
    assert call.code == 'print("hello")' and call.status == "completed"
    assert call.outputs[0].type == "logs" and call.outputs[0].logs == "hello\n"
    types = [e.type for e in events]
    for expected in (
        "response.code_interpreter_call.in_progress",
        "response.code_interpreter_call_code.delta",
        "response.code_interpreter_call_code.done",
        "response.code_interpreter_call.interpreting",
        "response.code_interpreter_call.completed",
    ):
        assert expected in types
    assert "## python" in prompt_of(sim.requests[-2])
    assert "<|start|>python to=assistant<|channel|>analysis<|message|>hello" in prompt_of(sim.requests[-1])


async def test_builtin_without_backing_server_is_400(strict_gateway) -> None:
    async with openai.AsyncOpenAI(base_url=strict_gateway.base_url, api_key="k", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search_preview"}])
        assert info.value.param == "tools[0].type" and "web_search" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            await c.responses.create(model=MODEL, input="hi", tools=[{"type": "code_interpreter"}])
        assert info.value.param == "tools[0].type"


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.1", "169.254.169.254", "[::1]", "localhost"])
async def test_ssrf_refused_without_allow(strict_gateway, docs, host) -> None:
    url = docs.url.replace("127.0.0.1", host)
    async with openai.AsyncOpenAI(base_url=strict_gateway.base_url, api_key="k", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.responses.create(
                model=MODEL, input="search_docs", tools=[docs_tool(docs, server_url=url)]
            )
    assert info.value.param == "tools[0].server_url"
    assert "--mcp-allow-hosts" in info.value.message


async def test_unreachable_server_fails_before_generation(mc, sim) -> None:
    before = len(sim.requests)
    with pytest.raises(openai.APIStatusError) as info:
        await mc.responses.create(
            model=MODEL,
            input="x",
            tools=[{"type": "mcp", "server_label": "gone", "server_url": "http://127.0.0.1:9/mcp"}],
        )
    assert info.value.status_code == 424
    assert "gone" in info.value.message
    assert len(sim.requests) == before


async def test_headers_sent_but_never_echoed(mc, docs) -> None:
    secret = "Bearer s3cret-token"
    r = await mc.responses.create(
        model=MODEL,
        input="lookup_user for dave",
        tools=[docs_tool(docs, headers={"Authorization": secret})],
    )
    assert any(h.get("authorization") == secret for h in docs.headers_seen)
    assert "s3cret" not in r.model_dump_json()
    stored = await mc.responses.retrieve(r.id)
    assert "s3cret" not in stored.model_dump_json()


async def test_tool_metrics_recorded(mcp_gateway, mc, docs) -> None:
    await mc.responses.create(model=MODEL, input="lookup_user for erin", tools=[docs_tool(docs)])
    async with httpx.AsyncClient() as http:
        text = (await http.get(mcp_gateway.url + "/metrics")).text
    assert 'gateway_mcp_tool_calls_total{outcome="success",server="docs",tool="lookup_user"}' in text
    assert "gateway_mcp_iterations_bucket" in text
    assert "gateway_mcp_tool_duration_seconds_count" in text


async def test_two_calls_in_one_turn_are_reported_in_order(mc, sim, docs) -> None:
    """Output after a call is held until the call's item is complete, so items never interleave."""
    events, final = await collect(
        mc, model=MODEL, input="[[two_calls]] search_docs and lookup_user for zed", tools=[docs_tool(docs)]
    )
    calls = [i for i in final.output if i.type == "mcp_call"]
    assert [c.name for c in calls] == ["search_docs", "lookup_user"]
    assert all(c.status == "completed" for c in calls)
    assert calls[1].output == "User zed is an administrator."
    second = prompt_of(sim.requests[-1])
    assert second.index("Docs result for zed") < second.index("User zed is an administrator")


async def test_background_response_runs_the_loop(mc, docs) -> None:
    import asyncio

    r = await mc.responses.create(
        model=MODEL, input="Please search_docs for later", tools=[docs_tool(docs)], background=True
    )
    assert r.status in ("queued", "in_progress")
    for _ in range(200):
        polled = await mc.responses.retrieve(r.id)
        if polled.status not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.05)
    assert polled.status == "completed"
    assert kinds(polled) == ["mcp_list_tools", "reasoning", "mcp_call", "reasoning", "message"]
    assert "Docs result for later" in polled.output_text


class _FailNextGeneration(list[tuple[str, dict[str, Any]]]):
    """The docs server's call log, arming an engine failure whenever a tool runs: the generation after
    the call (the tool loop's second) dies mid-stream."""

    def __init__(self, sim: Any) -> None:
        super().__init__()
        self.sim = sim

    def append(self, item: tuple[str, dict[str, Any]]) -> None:
        super().append(item)
        self.sim.fail_next(grpc.StatusCode.INTERNAL, after_tokens=3, message="engine crashed")


async def test_engine_failing_in_a_later_iteration_ends_the_stream_failed_and_stored(
    mcp_gateway, sim
) -> None:
    """The tool loop is one source on the stream driver: a failure in its second generation, after the
    call's items went out, ends the stream with `response.failed` (stored, as OpenAI keeps it), closes
    what the loop opened, and aborts the engine request."""
    calls = _FailNextGeneration(sim)
    async with serve_mcp(build_docs_server(calls)) as failing_docs:
        before = len(sim.requests)
        aborted = len(sim.aborted)
        body = {
            "model": MODEL,
            "input": "Please search_docs for crashes",
            "tools": [docs_tool(failing_docs)],
            "store": True,
        }
        events = await raw_stream(mcp_gateway, body)
    types = [e["type"] for e in events]
    assert "response.mcp_call.completed" in types  # the first generation and the call went out
    assert types[-1] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "engine crashed" in failed["error"]["message"]
    assert calls == [("search_docs", {"query": "crashes"})]
    assert len(sim.requests) - before == 2  # the loop's second generation is the one that died
    await wait_until(lambda: len(sim.aborted) > aborted)
    async with openai.AsyncOpenAI(base_url=mcp_gateway.base_url, api_key="k") as client:
        stored = await client.responses.retrieve(failed["id"])
    assert stored.status == "failed"
    assert [item.type for item in stored.output][:3] == ["mcp_list_tools", "reasoning", "mcp_call"]
