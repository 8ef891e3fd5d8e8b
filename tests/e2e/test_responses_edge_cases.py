"""Responses edge cases end to end: Harmony metrics, the reasoning budget (plain, streamed, across the
tool loop), a client leaving mid tool call, and input items (references, unknown call ids, summary-only
reasoning, a developer message mid-conversation)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from mcp.server.mcpserver import MCPServer

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.mcp.servers import RunningMcp, build_docs_server, serve_mcp
from tests.support.responses_stream import validate_event_stream
from tests.support.servers import RunningGateway, running_gateway, test_settings, wait_until

LONG = "Explain the plan [[long]]"
ANSWER = 'You said: "Explain the plan". This is a simulated answer.'


def _tokens(text: str) -> int:
    return len(get_encoding().encode(text, allowed_special=set()))


def _prompt(sim: RunningSim) -> str:
    return get_encoding().decode(sim.requests[-1].input_ids)


def _harmony_requests(gw: RunningGateway) -> float:
    return gw.state.metrics.registry.get_sample_value("gateway_harmony_requests_total") or 0.0


# -- metrics -------------------------------------------------------------------------------------------
async def test_responses_feed_the_harmony_counters(
    client: openai.AsyncOpenAI, gateway: RunningGateway
) -> None:
    registry = gateway.state.metrics.registry
    analysis_before = (
        registry.get_sample_value("gateway_harmony_channel_messages_total", {"channel": "analysis"}) or 0
    )
    start = _harmony_requests(gateway)
    await client.responses.create(model=MODEL, input="count me")
    assert _harmony_requests(gateway) == start + 1
    async with client.responses.stream(model=MODEL, input="count me streamed") as stream:
        await stream.get_final_response()
    await wait_until(lambda: _harmony_requests(gateway) == start + 2, timeout=5)
    bg = await client.responses.create(model=MODEL, input="count me later", background=True)
    await wait_until(lambda: _harmony_requests(gateway) == start + 3, timeout=10)
    assert (await client.responses.retrieve(bg.id)).status == "completed"
    analysis = registry.get_sample_value("gateway_harmony_channel_messages_total", {"channel": "analysis"})
    assert analysis == analysis_before + 3


# -- reasoning budget ------------------------------------------------------------------------------------
async def test_budget_cuts_reasoning_and_reports_it(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    start = len(sim.requests)
    r = await client.responses.create(model=MODEL, input=LONG, reasoning={"max_tokens": 40})
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert _tokens(r.output[0].content[0].text) <= 41
    assert r.output_text == ANSWER and r.status == "completed"
    assert r.usage.output_tokens_details.model_extra["reasoning_budget_exceeded"] is True
    first, second = sim.requests[start:]
    assert first.request_id in sim.aborted and second.request_id == first.request_id + "-answer0"
    stored = await client.responses.retrieve(r.id)
    assert stored.usage.output_tokens_details.model_extra["reasoning_budget_exceeded"] is True


async def test_budget_in_a_stream(client: openai.AsyncOpenAI) -> None:
    events = []
    async with client.responses.stream(model=MODEL, input=LONG, reasoning={"max_tokens": 40}) as stream:
        async for event in stream:
            events.append(event.model_dump(exclude_unset=True, warnings=False))
        final = await stream.get_final_response()
    validate_event_stream(events)
    assert final.output_text == ANSWER
    assert final.usage.output_tokens_details.model_extra["reasoning_budget_exceeded"] is True


async def test_budget_not_reached(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    start = len(sim.requests)
    r = await client.responses.create(model=MODEL, input="short one", reasoning={"max_tokens": 500})
    assert len(sim.requests) - start == 1
    assert r.usage.output_tokens_details.model_extra["reasoning_budget_exceeded"] is False
    plain = await client.responses.create(model=MODEL, input="no budget")
    assert "reasoning_budget_exceeded" not in (plain.usage.output_tokens_details.model_extra or {})


@pytest.fixture(scope="module")
async def docs() -> AsyncIterator[RunningMcp]:
    async with serve_mcp(build_docs_server([])) as running:
        yield running


@dataclass
class HangingCalls:
    """What the hanging tool went through, as events a test waits for (replaced per test)."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture(scope="module")
async def hanging_probe() -> list[HangingCalls]:
    return [HangingCalls()]


@pytest.fixture
async def hanging_calls(hanging_probe: list[HangingCalls]) -> HangingCalls:
    hanging_probe[0] = HangingCalls()
    return hanging_probe[0]


@pytest.fixture(scope="module")
async def hanging(hanging_probe: list[HangingCalls]) -> AsyncIterator[RunningMcp]:
    server = MCPServer("slow")

    @server.tool()
    async def hang_tool(topic: str) -> str:
        """Takes far longer than any test waits."""
        calls = hanging_probe[0]
        calls.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            calls.cancelled.set()
            raise
        return "never"

    async with serve_mcp(server) as running:
        yield running


@pytest.fixture(scope="module")
async def tools_gateway(sim: RunningSim) -> AsyncIterator[RunningGateway]:
    settings = test_settings(worker_urls=(sim.url,), mcp_allow_hosts=("127.0.0.1",), mcp_tool_timeout=30)
    async with running_gateway(settings) as gw:
        yield gw


def _mcp(label: str, server: RunningMcp) -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "server_url": server.url, "require_approval": "never"}


async def test_budget_covers_the_whole_tool_loop(tools_gateway: RunningGateway, docs: RunningMcp) -> None:
    budget = 600
    async with openai.AsyncOpenAI(base_url=tools_gateway.base_url, api_key="k", max_retries=0) as c:
        r = await c.responses.create(
            model=MODEL,
            input="Use search_docs for coffee [[long]]",
            tools=[_mcp("docs", docs)],
            reasoning={"max_tokens": budget},
        )
    assert [item.type for item in r.output] == [
        "mcp_list_tools",
        "reasoning",
        "mcp_call",
        "reasoning",
        "message",
    ]
    first = _tokens(r.output[1].content[0].text)
    second = _tokens(r.output[3].content[0].text)
    assert first < budget  # the first turn reasoned within the budget and called the tool
    assert second <= budget - first + 5  # the second turn had only what was left
    assert r.output[2].output and r.output[-1].status == "completed"
    assert r.usage.output_tokens_details.model_extra["reasoning_budget_exceeded"] is True


# -- a client leaving mid tool call ------------------------------------------------------------------------
async def test_disconnect_mid_tool_call_cancels_it_and_stores_nothing(
    tools_gateway: RunningGateway, hanging: RunningMcp, hanging_calls: HangingCalls, sim: RunningSim
) -> None:
    """The client leaves only once the tool call has started (an event the tool sets), and the checks
    run only once the gateway has finished the request (its metrics recorded it): no sleeps, so a
    loaded machine changes how long the test takes, never what it sees. It used to leave too early
    now and then: the line iterator it broke out of was finalised, closing the response."""
    body = {
        "model": MODEL,
        "input": "Use hang_tool for tea",
        "tools": [_mcp("slow", hanging)],
        "stream": True,
    }
    metrics = tools_gateway.state.metrics
    observe = metrics.observe
    finished: dict[str, asyncio.Event] = {}

    def observing(ctx: Any) -> None:
        observe(ctx)
        finished.setdefault(ctx.request_id, asyncio.Event()).set()

    response_id = request_id = None
    metrics.observe = observing
    try:
        async with httpx.AsyncClient(base_url=tools_gateway.url, timeout=30) as http:
            async with http.stream("POST", "/v1/responses", json=body) as resp:
                assert resp.status_code == 200
                request_id = resp.headers["x-request-id"]
                # Held, not left to the garbage collector: a dropped line iterator is finalised by a
                # task that closes the response, and the client would leave before the call started.
                lines = resp.aiter_lines()
                async for line in lines:
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event["type"] == "response.created":
                        response_id = event["response"]["id"]
                    if event["type"] == "response.mcp_call_arguments.done":
                        break
                # The watchdog bounds a hang; the order is the event's.
                await asyncio.wait_for(hanging_calls.started.wait(), timeout=30)
                engine_requests = len(sim.requests)
            # Leaving the block closed the connection while the tool runs.
            await asyncio.wait_for(hanging_calls.cancelled.wait(), timeout=30)
            done = finished.setdefault(request_id, asyncio.Event())
            await asyncio.wait_for(done.wait(), timeout=30)
            assert len(sim.requests) == engine_requests  # the loop did not go on to the next turn
            assert response_id is not None
            missing = await http.get(f"/v1/responses/{response_id}")
            assert missing.status_code == 404
    finally:
        del metrics.observe


# -- input items -----------------------------------------------------------------------------------------
async def test_item_reference_to_the_chain_and_the_conversation(client: openai.AsyncOpenAI, sim) -> None:
    r1 = await client.responses.create(model=MODEL, input="remember the kiwi fact")
    user_item = (await client.responses.input_items.list(r1.id)).data[0]
    await client.responses.create(
        model=MODEL,
        previous_response_id=r1.id,
        input=[{"type": "item_reference", "id": user_item.id}, {"role": "user", "content": "go on"}],
    )
    assert _prompt(sim).count("<|start|>user<|message|>remember the kiwi fact<|end|>") == 2

    conv = await client.conversations.create(items=[{"role": "user", "content": "conversation fact alpha"}])
    item = (await client.conversations.items.list(conv.id)).data[0]
    await client.responses.create(
        model=MODEL, conversation=conv.id, input=[{"type": "item_reference", "id": item.id}]
    )
    assert _prompt(sim).count("<|start|>user<|message|>conversation fact alpha<|end|>") == 2
    # The referenced item is not appended again; the turn's output is.
    kinds = [i.type for i in (await client.conversations.items.list(conv.id, order="asc")).data]
    assert kinds == ["message", "reasoning", "message"]

    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(
            model=MODEL,
            previous_response_id=r1.id,
            input=[{"role": "user", "content": "x"}, {"type": "item_reference", "id": "msg_nowhere"}],
        )
    assert info.value.param == "input[1].id"


async def test_function_call_output_with_unknown_call_id(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_unknown", "output": "42"},
            ],
        )
    assert info.value.param == "input[1].call_id"


async def test_summary_only_reasoning_is_skipped(client: openai.AsyncOpenAI, sim) -> None:
    r = await client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "first question"},
            {
                "type": "reasoning",
                "id": "rs_summary",
                "summary": [{"type": "summary_text", "text": "SUMMARY ONLY TEXT"}],
            },
            {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "second question"},
        ],
    )
    assert r.status == "completed"
    prompt = _prompt(sim)
    assert "SUMMARY ONLY TEXT" not in prompt and "first answer" in prompt


async def test_developer_message_mid_conversation_stays_in_place(client: openai.AsyncOpenAI, sim) -> None:
    await client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "opening question"},
            {"role": "developer", "content": "from now on answer in French"},
            {"role": "user", "content": "closing question"},
        ],
    )
    prompt = _prompt(sim)
    developer = prompt.index(
        "<|start|>developer<|message|># Instructions\n\nfrom now on answer in French<|end|>"
    )
    assert prompt.index("opening question") < developer < prompt.index("closing question")
