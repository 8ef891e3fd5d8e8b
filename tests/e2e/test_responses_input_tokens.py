"""`POST /v1/responses/input_tokens` over real HTTP, the official SDK and the gRPC sim: for every input
shape (a string, items, instructions, tools, a `previous_response_id` chain, a conversation, a compaction
item) the count equals the `usage.input_tokens` the engine then reports for the same request, and the
prompt length the engine received. Bodies validate against OpenAI's schemas; bad input is a 400 naming
its param; keys and tenants apply; traffic control weighs it as a tokenizing route."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from harmony_gateway.sim import RunningSim
from harmony_gateway.surfaces.table import route_map
from harmony_gateway.traffic.routes import TOKENIZING
from tests.conftest import MODEL
from tests.e2e.test_reasoning_tenants import KEY_A, KEY_B, http_as
from tests.support.published_schemas import assert_valid
from tests.support.servers import RunningGateway, running_gateway, test_settings

WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}
ITEMS: list[dict[str, Any]] = [
    {"role": "developer", "content": "Answer in one line."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
]


@pytest.fixture
async def http(gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as c:
        yield c


async def count_raw(http: httpx.AsyncClient, body: dict[str, Any]) -> int:
    assert_valid("TokenCountsBody", body)
    r = await http.post("/responses/input_tokens", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert_valid("TokenCountsResource", data)
    assert data["object"] == "response.input_tokens"
    return int(data["input_tokens"])


async def assert_counts_what_the_engine_gets(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, sim: RunningSim, body: dict[str, Any]
) -> None:
    counted = await count_raw(http, body)
    sdk = await client.responses.input_tokens.count(**body)
    assert sdk.object == "response.input_tokens" and sdk.input_tokens == counted
    before = len(sim.requests)
    response = await client.responses.create(**{"model": MODEL, **body})
    assert len(sim.requests) == before + 1
    assert response.usage is not None
    assert counted == response.usage.input_tokens == len(sim.requests[before].input_ids)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"model": MODEL, "input": "Tell me a joke."}, id="string"),
        pytest.param({"model": MODEL, "input": ITEMS, "tools": [WEATHER]}, id="items"),
        pytest.param(
            {
                "model": MODEL,
                "input": "Hi",
                "instructions": "Talk like a pirate.",
                "reasoning": {"effort": "high"},
            },
            id="instructions",
        ),
        pytest.param(
            {
                "model": MODEL,
                "input": "What is the weather in Oslo?",
                "tools": [WEATHER, {"type": "function", "name": "ping", "parameters": None, "strict": False}],
                "tool_choice": {"type": "function", "name": "get_weather"},
            },
            id="tools",
        ),
        pytest.param(
            {
                "model": MODEL,
                "input": "Reply as JSON.",
                "text": {"format": {"type": "json_schema", "name": "reply", "schema": {"type": "object"}}},
            },
            id="text-format",
        ),
        pytest.param({"input": "Which model?"}, id="no-model"),
    ],
)
async def test_counts_equal_the_engines_usage(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, sim: RunningSim, body: dict[str, Any]
) -> None:
    await assert_counts_what_the_engine_gets(client, http, sim, body)


async def test_counts_a_previous_response_chain(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, sim: RunningSim
) -> None:
    first = await client.responses.create(model=MODEL, input="Remember the number 42.", tools=[WEATHER])  # type: ignore[list-item]
    second = await client.responses.create(model=MODEL, input="And 43.", previous_response_id=first.id)
    body = {"model": MODEL, "input": "Which numbers?", "previous_response_id": second.id}
    await assert_counts_what_the_engine_gets(client, http, sim, body)


async def test_counts_a_conversation(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, sim: RunningSim
) -> None:
    conversation = await client.conversations.create(items=[{"role": "user", "content": "Hello there."}])
    await client.responses.create(model=MODEL, input="I like tea.", conversation=conversation.id)
    body = {"model": MODEL, "input": "What do I like?", "conversation": {"id": conversation.id}}
    await assert_counts_what_the_engine_gets(client, http, sim, body)


async def test_counts_a_compacted_conversation(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, sim: RunningSim
) -> None:
    compacted = await client.responses.compact(model=MODEL, input=ITEMS)  # type: ignore[arg-type]
    fed = [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]
    body = {"model": MODEL, "input": [*fed, {"role": "user", "content": "And tomorrow?"}]}
    await assert_counts_what_the_engine_gets(client, http, sim, body)
    assert await count_raw(http, body) < await count_raw(
        http, {"model": MODEL, "input": ITEMS, "tools": [WEATHER]}
    )


async def test_fields_it_does_not_take_change_nothing(http: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "input": "Fields it does not take."}
    extra = {"background": True, "store": False, "stream": True, "personality": "friendly"}
    assert await count_raw(http, {**body, **extra}) == await count_raw(http, body)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "input": 7}, 400, "input"),
        ({"model": MODEL, "input": [{"type": "bogus"}]}, 400, "input[0].type"),
        ({"model": MODEL, "input": "x", "tools": [{"type": "bogus"}]}, 400, "tools[0].type"),
        ({"model": MODEL, "input": "x", "truncation": "sometimes"}, 400, "truncation"),
        ({"model": MODEL, "input": "x", "reasoning": {"effort": "none"}}, 400, "reasoning.effort"),
        ({"model": MODEL, "input": "x", "tool_choice": "required"}, 400, "tool_choice"),
        (
            {"model": MODEL, "input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"},
            400,
            "previous_response_id",
        ),
        ({"model": MODEL, "input": "x", "previous_response_id": "resp_missing"}, 400, "previous_response_id"),
        ({"model": MODEL, "input": "x", "conversation": "conv_missing"}, 404, "conversation"),
        ({"model": "no-such-model", "input": "x"}, 404, "model"),
    ],
)
async def test_bad_input_names_its_param(
    http: httpx.AsyncClient, body: dict[str, Any], status: int, param: str
) -> None:
    r = await http.post("/responses/input_tokens", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


async def test_sdk_raises_with_the_param(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await client.responses.input_tokens.count(model=MODEL, input="x", truncation="sometimes")  # type: ignore[arg-type]
    assert bad.value.param == "truncation"  # type: ignore[attr-defined]


async def test_keys_and_tenants_apply(sim: RunningSim) -> None:
    settings = test_settings(worker_urls=(sim.url,), api_keys=frozenset({KEY_A, KEY_B}))
    async with running_gateway(settings) as gw, http_as(gw, KEY_A) as a, http_as(gw, KEY_B) as b:
        made = await a.post("/responses", json={"model": MODEL, "input": "A's secret"})
        assert made.status_code == 200, made.text
        body = {"model": MODEL, "input": "x", "previous_response_id": made.json()["id"]}
        assert (await a.post("/responses/input_tokens", json=body)).status_code == 200
        foreign = await b.post("/responses/input_tokens", json=body)
        assert foreign.status_code == 400 and foreign.json()["error"]["param"] == "previous_response_id"
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as anonymous:
            r = await anonymous.post("/responses/input_tokens", json={"model": MODEL, "input": "x"})
            assert r.status_code == 401


def test_traffic_control_weighs_it_as_tokenizing() -> None:
    assert route_map().cost("POST", "/v1/responses/input_tokens") is TOKENIZING
