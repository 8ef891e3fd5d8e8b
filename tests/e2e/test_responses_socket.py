"""The Responses API's WebSocket mode through a real uvicorn server on loopback: the official SDK's
`client.responses.connect()`, openai-agents' `OpenAIResponsesWSModel`, and a plain `websockets` client
for the protocol's edges (handshake, error events, limits, the drain, a client leaving mid-turn). Every
server event is checked against OpenAI's `ResponsesServerEvent` and, as the stream event it is, against
both published schemas and the stream invariant."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import websockets
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesWSModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.settings import KeyPolicy
from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.published_schemas import assert_valid_socket_events
from tests.support.responses_stream import TERMINAL, validate_event_stream
from tests.support.servers import RunningGateway, running_gateway, test_settings, wait_until

set_tracing_disabled(True)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "Current time",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def socket_url(gateway: RunningGateway) -> str:
    return gateway.url.replace("http://", "ws://") + "/v1/responses"


@contextlib.asynccontextmanager
async def open_socket(gateway: RunningGateway, key: str | None = None) -> AsyncIterator[ClientConnection]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with websockets.connect(socket_url(gateway), additional_headers=headers, max_size=None) as ws:
        yield ws


async def send(ws: ClientConnection, **event: Any) -> None:
    await ws.send(json.dumps({"type": "response.create", **event}))


async def next_event(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), 30))  # type: ignore[no-any-return]


async def turn(ws: ClientConnection, **event: Any) -> list[dict[str, Any]]:
    """Send one response.create and read its events to the terminal one (or the error event)."""
    if event:
        await send(ws, **event)
    events = []
    while True:
        events.append(await next_event(ws))
        if events[-1]["type"] in TERMINAL:
            return events


def check_turn(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A turn's events valid as socket events and as a stream; returns its final Response."""
    assert_valid_socket_events(events)
    validate_event_stream([{k: v for k, v in e.items() if k != "stream_id"} for e in events])
    assert events[-1]["type"] == "response.completed", events[-1]
    return events[-1]["response"]  # type: ignore[no-any-return]


async def expect_error(ws: ClientConnection) -> dict[str, Any]:
    event = await next_event(ws)
    assert event["type"] == "error", event
    assert_valid_socket_events([event])
    return event["error"]  # type: ignore[no-any-return]


async def closed_with(ws: ClientConnection) -> tuple[int, str]:
    """Wait for the server to close the socket; its close code and reason."""
    with pytest.raises(ConnectionClosed):
        while True:
            await asyncio.wait_for(ws.recv(), 30)
    assert ws.close_code is not None
    return ws.close_code, ws.close_reason or ""


def prompt_of(sim: RunningSim) -> str:
    return get_encoding().decode(sim.requests[-1].input_ids)


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def metrics_once(http: httpx.AsyncClient, ready: Any, timeout: float = 10.0) -> str:
    """The /metrics text once `ready(text)` holds: a turn is counted when its bookkeeping ends, just
    after its last event went out, and a socket when its handler returns."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        text = (await http.get("/metrics")).text
        if ready(text):
            return text
        assert asyncio.get_running_loop().time() < deadline, "the metrics never showed it"
        await asyncio.sleep(0.02)


# -- the official SDK's connect() ----------------------------------------------------------------------
async def sdk_turn(conn: Any, **params: Any) -> list[dict[str, Any]]:
    """One turn through the SDK: `conn.response.create`, then the raw events (each also parsed by the
    SDK) to the terminal one."""
    await conn.response.create(**params)
    events = []
    while True:
        raw = await asyncio.wait_for(conn.recv_bytes(), 30)
        parsed = conn.parse_event(raw)
        event = json.loads(raw)
        assert parsed.type == event["type"]
        events.append(event)
        if event["type"] in TERMINAL:
            return events


async def test_sdk_connect_continues_a_store_false_chain_from_the_socket(
    client: openai.AsyncOpenAI, sim: RunningSim
) -> None:
    async with client.responses.connect() as conn:
        first = check_turn(await sdk_turn(conn, model=MODEL, input="Remember the word saffron.", store=False))
        assert first["store"] is False and "simulated answer" in first["output"][-1]["content"][0]["text"]
        second = check_turn(
            await sdk_turn(
                conn, model=MODEL, input="Which word?", store=False, previous_response_id=first["id"]
            )
        )
        assert second["previous_response_id"] == first["id"]
        prompt = prompt_of(sim)
        # The first turn's input and answer are in the second turn's prompt, read from the socket's
        # cache: neither response was stored.
        assert "Remember the word saffron." in prompt and "Which word?" in prompt
        assert 'You said: "Remember the word saffron."' in prompt
        third = check_turn(
            await sdk_turn(conn, model=MODEL, input="Again?", store=False, previous_response_id=second["id"])
        )
        assert (
            "Which word?" in prompt_of(sim)
            and third["usage"]["input_tokens"] > second["usage"]["input_tokens"]
        )
    for response in (first, second, third):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response["id"])


async def test_sdk_connect_runs_a_function_call_tool_loop(
    client: openai.AsyncOpenAI, sim: RunningSim
) -> None:
    tools = [WEATHER, TIME]
    async with client.responses.connect() as conn:
        response = check_turn(
            await sdk_turn(
                conn,
                model=MODEL,
                store=False,
                tools=tools,
                input="[[sequence]] please call get_weather for Paris and get_time for Paris",
            )
        )
        called = []
        while response["output"][-1]["type"] == "function_call":
            call = response["output"][-1]
            called.append(call["name"])
            response = check_turn(
                await sdk_turn(
                    conn,
                    model=MODEL,
                    store=False,
                    tools=tools,
                    previous_response_id=response["id"],
                    input=[
                        {
                            "type": "function_call_output",
                            "call_id": call["call_id"],
                            "output": f"{call['name']} says fine",
                        }
                    ],
                )
            )
            assert len(called) < 5
    assert called == ["get_weather", "get_time"]
    assert "get_time says fine" in response["output"][-1]["content"][0]["text"]


async def test_sdk_warm_up_turn_generates_nothing_and_is_continued(
    client: openai.AsyncOpenAI, sim: RunningSim
) -> None:
    async with client.responses.connect() as conn:
        engine_calls = len(sim.requests)
        warm = check_turn(
            await sdk_turn(
                conn,
                model=MODEL,
                store=False,
                generate=False,
                instructions="Be terse.",
                input="Hi, I am Ana.",
            )
        )
        assert warm["output"] == [] and len(sim.requests) == engine_calls
        answer = check_turn(
            await sdk_turn(conn, model=MODEL, store=False, previous_response_id=warm["id"], input="Who am I?")
        )
        assert answer["output"][-1]["type"] == "message"
        assert "Hi, I am Ana." in prompt_of(sim)


# -- openai-agents' WebSocket model ---------------------------------------------------------------------
@function_tool
def get_weather(city: str) -> str:
    """Get the weather for a city."""
    return f"It is sunny in {city}."


@pytest.mark.parametrize("store", [True, False])
async def test_agents_websocket_model_runs_an_agent_with_a_function_tool(
    client: openai.AsyncOpenAI, gateway: RunningGateway, store: bool
) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        before = (await http.get("/metrics")).text
        model = OpenAIResponsesWSModel(model=MODEL, openai_client=client)
        try:
            agent = Agent(
                name="assistant",
                instructions="Answer briefly.",
                model=model,
                tools=[get_weather],
                model_settings=ModelSettings(store=store),
            )
            result = await Runner.run(agent, "Call get_weather for Paris", auto_previous_response_id=True)
            assert "It is sunny in Paris" in result.final_output
            # Both model calls ran on one socket: the second continued the first.
            again = await Runner.run(agent, "Call get_weather for Rome", auto_previous_response_id=True)
            assert "It is sunny in Rome" in again.final_output
        finally:
            await model.close()
        requests = "gateway_requests_total"
        done = metric(before, requests, route="responses_ws", status="200") + 4
        after = await metrics_once(
            http, lambda text: metric(text, requests, route="responses_ws", status="200") >= done
        )
    accepted = "gateway_websocket_handshakes_total"
    assert metric(after, accepted, outcome="accepted") - metric(before, accepted, outcome="accepted") == 1
    assert metric(after, requests, route="responses_ws", status="200") == done
    continued = "gateway_websocket_continuations_total"
    assert metric(after, continued, source="cache") - metric(before, continued, source="cache") == 2


async def test_a_turn_sends_the_events_of_a_stream(gateway: RunningGateway) -> None:
    body = {"model": MODEL, "input": "please call get_weather for Oslo", "tools": [WEATHER], "store": False}
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        async with http.stream("POST", "/responses", json={**body, "stream": True}) as r:
            streamed = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
    async with open_socket(gateway) as ws:
        sent = await turn(ws, **body)
    check_turn(sent)

    def shape(events: list[dict[str, Any]]) -> list[tuple[str, int, Any]]:
        return [(e["type"], e["sequence_number"], e.get("delta")) for e in events]

    assert shape(sent) == shape(streamed)
    assert (
        sent[-1]["response"]["output"][-1]["arguments"] == streamed[-1]["response"]["output"][-1]["arguments"]
    )


# -- a plain client: the protocol's edges ---------------------------------------------------------------
async def test_background_is_refused_and_the_socket_stays_open(gateway: RunningGateway) -> None:
    async with open_socket(gateway) as ws:
        await send(ws, model=MODEL, input="hi", background=True)
        error = await expect_error(ws)
        assert error["param"] == "background" and error["type"] == "invalid_request_error"
        check_turn(await turn(ws, model=MODEL, input="hi"))


@pytest.mark.parametrize(
    ("message", "param", "code"),
    [
        ("{not json", None, "invalid_json"),
        ("[1, 2]", None, "invalid_event"),
        (json.dumps({"type": "response.cancel"}), "type", "invalid_event"),
        (
            json.dumps({"type": "response.steer", "previous_response_id": "r", "input": "x"}),
            "type",
            "invalid_event",
        ),
        (json.dumps({"model": MODEL, "input": "no type"}), "type", "invalid_event"),
        (json.dumps({"type": "response.create", "input": "no model"}), "model", None),
        (json.dumps({"type": "response.create", "model": MODEL, "temperature": 7}), "temperature", None),
        (json.dumps({"type": "response.create", "model": MODEL, "stream_id": "a b"}), "stream_id", None),
        (json.dumps({"type": "response.create", "model": MODEL, "generate": "no"}), "generate", None),
        (
            json.dumps({"type": "response.create", "model": MODEL, "previous_response_id": "resp_nope"}),
            "previous_response_id",
            "previous_response_not_found",
        ),
        (json.dumps({"type": "response.create", "model": "nobody"}), "model", "model_not_found"),
    ],
)
async def test_bad_input_is_an_error_event_and_the_socket_stays_usable(
    gateway: RunningGateway, message: str, param: str | None, code: str | None
) -> None:
    async with open_socket(gateway) as ws:
        await ws.send(message)
        event = await next_event(ws)
        assert event["type"] == "error" and event["status"] in (400, 404), event
        assert_valid_socket_events([event])
        error = event["error"]
        assert error["param"] == param and error["message"]
        if code is not None:
            assert error["code"] == code
        assert error["headers"]["x-request-id"]
        check_turn(await turn(ws, model=MODEL, input="still here?"))


async def test_a_second_response_create_while_one_is_in_flight_is_refused(
    gateway: RunningGateway, sim: RunningSim
) -> None:
    async with open_socket(gateway) as ws:
        sim.hold()
        try:
            await send(ws, model=MODEL, input="first")
            await wait_until(lambda: sim.active_requests == 1)
            await send(ws, model=MODEL, input="second")
            error = await expect_error(ws)
            assert error["code"] == "response_already_in_flight"
        finally:
            sim.release_held()
        first = check_turn(await turn(ws))
        assert 'You said: "first"' in first["output"][-1]["content"][0]["text"]
        # Right after the terminal event, the next turn is taken.
        second = check_turn(await turn(ws, model=MODEL, input="second", previous_response_id=first["id"]))
        assert second["previous_response_id"] == first["id"]


async def test_stream_id_is_echoed_on_every_event(gateway: RunningGateway) -> None:
    async with open_socket(gateway) as ws:
        events = await turn(ws, model=MODEL, input="lane", stream_id="agent_1")
        check_turn(events)
        assert {e.get("stream_id") for e in events} == {"agent_1"}
        await send(ws, model=MODEL, input="lane", stream_id="agent_1", background=True)
        event = await next_event(ws)
        assert event["type"] == "error" and event["stream_id"] == "agent_1"


async def test_a_client_that_leaves_mid_turn_aborts_the_engine_request(
    gateway: RunningGateway, sim: RunningSim
) -> None:
    aborted = len(sim.aborted)
    sim.hold()
    try:
        async with open_socket(gateway) as ws:
            await send(ws, model=MODEL, input="leaving")
            await wait_until(lambda: sim.active_requests == 1)
        await wait_until(lambda: len(sim.aborted) == aborted + 1)
        await wait_until(lambda: sim.active_requests == 0)
    finally:
        sim.release_held()


async def test_a_stored_response_continues_on_another_socket(
    gateway: RunningGateway, sim: RunningSim
) -> None:
    async with open_socket(gateway) as ws:
        first = check_turn(await turn(ws, model=MODEL, input="Stored: the word is cobalt."))
    async with open_socket(gateway) as ws:
        second = check_turn(await turn(ws, model=MODEL, input="Which?", previous_response_id=first["id"]))
        assert "Stored: the word is cobalt." in prompt_of(sim)
        # ...and the new socket caches it: its next turn continues from there.
        check_turn(await turn(ws, model=MODEL, input="And?", store=False, previous_response_id=second["id"]))
        assert "Which?" in prompt_of(sim)


async def test_an_unstored_response_of_another_socket_is_not_found(gateway: RunningGateway) -> None:
    async with open_socket(gateway) as ws:
        first = check_turn(await turn(ws, model=MODEL, input="private", store=False))
    async with open_socket(gateway) as ws:
        await send(ws, model=MODEL, input="next", store=False, previous_response_id=first["id"])
        error = await expect_error(ws)
        assert (error["code"], error["param"]) == ("previous_response_not_found", "previous_response_id")


async def test_a_failed_turn_leaves_the_cache_as_it_was(gateway: RunningGateway, sim: RunningSim) -> None:
    async with open_socket(gateway) as ws:
        first = check_turn(await turn(ws, model=MODEL, input="keep me", store=False))
        sim.fail_next(after_tokens=3)
        failed = await turn(ws, model=MODEL, input="fails", store=False, previous_response_id=first["id"])
        assert failed[-1]["type"] == "response.failed"
        assert_valid_socket_events(failed)
        again = check_turn(
            await turn(ws, model=MODEL, input="retry", store=False, previous_response_id=first["id"])
        )
        assert again["previous_response_id"] == first["id"] and "keep me" in prompt_of(sim)


# -- keys, tenants and budgets -----------------------------------------------------------------------------
KEY_A, KEY_B, KEY_LIMITED, KEY_SPAMMER = "sk-tenant-a", "sk-tenant-b", "sk-limited", "sk-spammer"


@pytest.fixture(scope="module")
async def keyed(sim: RunningSim) -> AsyncIterator[RunningGateway]:
    settings = test_settings(
        worker_urls=(sim.url,),
        api_keys=frozenset({KEY_A, KEY_B, KEY_LIMITED, KEY_SPAMMER}),
        key_policies={KEY_LIMITED: KeyPolicy(rate_limit=2), KEY_SPAMMER: KeyPolicy(rate_limit=2)},
    )
    async with running_gateway(settings) as gw:
        yield gw


@pytest.mark.parametrize("key", [None, "sk-unknown"])
async def test_a_handshake_without_a_known_key_is_refused_with_401(
    keyed: RunningGateway, key: str | None
) -> None:
    with pytest.raises(InvalidStatus) as refused:
        async with open_socket(keyed, key):
            pass
    response = refused.value.response
    assert response.status_code == 401
    assert json.loads(response.body)["error"]["code"] == "invalid_api_key"


async def test_a_key_holds_at_most_its_share_of_open_sockets(sim: RunningSim) -> None:
    """Upgraded sockets skip the server's connection cap, so each key's open sockets are capped: one
    key past it is refused with 429, another key is not, and a closed socket frees its place."""
    settings = test_settings(
        worker_urls=(sim.url,), api_keys=frozenset({KEY_A, KEY_B}), ws_max_sockets_per_key=2
    )
    async with running_gateway(settings) as gw:
        async with open_socket(gw, KEY_A), open_socket(gw, KEY_A):
            with pytest.raises(InvalidStatus) as refused:
                async with open_socket(gw, KEY_A):
                    pass
            response = refused.value.response
            assert response.status_code == 429
            assert json.loads(response.body)["error"]["code"] == "too_many_websockets"
            async with open_socket(gw, KEY_B) as ws:
                check_turn(await turn(ws, model=MODEL, input="another key is not refused"))
        async with httpx.AsyncClient(base_url=gw.url) as http:  # the server has seen every socket close
            await metrics_once(http, lambda text: metric(text, "gateway_websocket_open") == 0)
        async with open_socket(gw, KEY_A) as ws:
            check_turn(await turn(ws, model=MODEL, input="the places are free again"))


async def test_another_tenants_response_cannot_be_continued(keyed: RunningGateway) -> None:
    async with open_socket(keyed, KEY_A) as ws:
        mine = check_turn(await turn(ws, model=MODEL, input="tenant a's secret"))
    async with open_socket(keyed, KEY_B) as ws:
        await send(ws, model=MODEL, input="steal", previous_response_id=mine["id"])
        error = await expect_error(ws)
        assert (error["code"], error["param"]) == ("previous_response_not_found", "previous_response_id")
    async with open_socket(keyed, KEY_A) as ws:
        check_turn(await turn(ws, model=MODEL, input="mine", previous_response_id=mine["id"]))


async def test_each_turn_is_rate_limited_as_a_request(keyed: RunningGateway) -> None:
    async with open_socket(keyed, KEY_LIMITED) as ws:
        check_turn(await turn(ws, model=MODEL, input="one"))
        check_turn(await turn(ws, model=MODEL, input="two"))
        await send(ws, model=MODEL, input="three")
        event = await next_event(ws)
        assert event["type"] == "error" and event["status"] == 429, event
        assert_valid_socket_events([event])
        error = event["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        assert int(error["headers"]["retry-after"]) >= 1
        assert error["headers"]["x-ratelimit-limit-requests"] == "2"
        await ws.ping()  # the socket stays open


async def test_refused_messages_are_charged_as_requests(keyed: RunningGateway) -> None:
    async with open_socket(keyed, KEY_SPAMMER) as ws:
        await ws.send("{")
        assert (await expect_error(ws))["code"] == "invalid_json"
        check_turn(await turn(ws, model=MODEL, input="one"))
        await ws.send("{")
        error = await expect_error(ws)
        assert (
            error["code"] == "rate_limit_exceeded"
            and error["headers"]["x-ratelimit-remaining-requests"] == "0"
        )


async def test_each_turn_takes_an_admission_slot(sim: RunningSim) -> None:
    settings = test_settings(worker_urls=(sim.url,), max_concurrent_requests=1, queue_size=0)
    async with running_gateway(settings) as gw, open_socket(gw) as first, open_socket(gw) as second:
        sim.hold()
        try:
            await send(first, model=MODEL, input="holds the slot")
            await wait_until(lambda: sim.active_requests == 1)
            await send(second, model=MODEL, input="finds none")
            error = await expect_error(second)
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        finally:
            sim.release_held()
        check_turn(await turn(first))
        # The slot is free as soon as the first turn's last event is out: the next turn, on either
        # socket, is admitted at once, with no queue to wait in.
        check_turn(await turn(first, model=MODEL, input="at once"))
        check_turn(await turn(second, model=MODEL, input="now there is one"))


# -- limits -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
async def limited(sim: RunningSim) -> AsyncIterator[RunningGateway]:
    settings = test_settings(
        worker_urls=(sim.url,), ws_max_turns=2, ws_idle_timeout=2.0, ws_max_message_bytes=64 * 1024
    )
    async with running_gateway(settings) as gw:
        yield gw


async def test_the_turn_after_the_limit_is_refused_and_the_socket_closes(limited: RunningGateway) -> None:
    async with open_socket(limited) as ws:
        check_turn(await turn(ws, model=MODEL, input="one"))
        check_turn(await turn(ws, model=MODEL, input="two"))
        await send(ws, model=MODEL, input="three")
        error = await expect_error(ws)
        assert error["code"] == "websocket_connection_limit_reached"
        assert await closed_with(ws) == (1000, "connection limit reached")


async def test_a_message_over_the_size_limit_closes_the_socket_with_1009(limited: RunningGateway) -> None:
    async with open_socket(limited) as ws:
        await send(ws, model=MODEL, input="x" * (64 * 1024))
        code, _ = await closed_with(ws)
        assert code == 1009


async def test_an_idle_socket_is_closed(limited: RunningGateway) -> None:
    async with open_socket(limited) as ws:
        check_turn(await turn(ws, model=MODEL, input="then nothing"))
        assert await closed_with(ws) == (1000, "idle timeout")


async def test_a_turn_past_the_lifetime_is_refused(sim: RunningSim) -> None:
    async with running_gateway(test_settings(worker_urls=(sim.url,), ws_max_lifetime=1e-6)) as gw:
        async with open_socket(gw) as ws:
            await send(ws, model=MODEL, input="too late")
            error = await expect_error(ws)
            assert error["code"] == "websocket_connection_limit_reached" and "lifetime" in error["message"]
            assert await closed_with(ws) == (1000, "connection limit reached")


# -- the drain ------------------------------------------------------------------------------------------------
async def test_the_drain_closes_an_idle_socket_with_1001_and_refuses_new_ones(sim: RunningSim) -> None:
    async with running_gateway(test_settings(worker_urls=(sim.url,))) as gw:
        async with open_socket(gw) as ws:
            check_turn(await turn(ws, model=MODEL, input="before the drain"))
            gw.app.state.traffic.begin_drain()
            assert await closed_with(ws) == (1001, "the gateway is shutting down")
        with pytest.raises(InvalidStatus) as refused:
            async with open_socket(gw):
                pass
        assert refused.value.response.status_code == 503
        assert json.loads(refused.value.response.body)["error"]["code"] == "shutting_down"


async def test_the_drain_lets_a_turn_finish_then_closes_its_socket(sim: RunningSim) -> None:
    async with running_gateway(test_settings(worker_urls=(sim.url,))) as gw:
        control = gw.app.state.traffic
        async with open_socket(gw) as ws:
            sim.hold()
            try:
                await send(ws, model=MODEL, input="finish me")
                await wait_until(lambda: sim.active_requests == 1)
                drained = asyncio.create_task(control.drain(30))
                await wait_until(lambda: control.draining)
            finally:
                sim.release_held()
            check_turn(await turn(ws))
            assert await closed_with(ws) == (1001, "the gateway is shutting down")
            assert await drained


async def test_the_drain_timeout_cuts_a_turn_with_an_error_event(sim: RunningSim) -> None:
    async with running_gateway(test_settings(worker_urls=(sim.url,))) as gw:
        control = gw.app.state.traffic
        aborted = len(sim.aborted)
        async with open_socket(gw) as ws:
            sim.hold()
            try:
                await send(ws, model=MODEL, input="cut me")
                await wait_until(lambda: sim.active_requests == 1)
                assert not await control.drain(0)
                error = await expect_error(ws)
                assert error["code"] == "shutting_down"
                assert await closed_with(ws) == (1001, "the gateway is shutting down")
            finally:
                sim.release_held()
        await wait_until(lambda: len(sim.aborted) == aborted + 1)


# -- metrics ---------------------------------------------------------------------------------------------------
async def test_sockets_are_counted(gateway: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        before = (await http.get("/metrics")).text
        async with open_socket(gateway) as ws:
            check_turn(await turn(ws, model=MODEL, input="counted"))
            await ws.send("{")
            await expect_error(ws)
            during = await metrics_once(
                http,
                lambda text: (
                    metric(text, "gateway_requests_total", route="responses_ws")
                    > metric(before, "gateway_requests_total", route="responses_ws")
                ),
            )
        closed_before = metric(before, "gateway_websocket_closed_total", reason="client")
        after = await metrics_once(
            http, lambda text: metric(text, "gateway_websocket_closed_total", reason="client") > closed_before
        )
    assert metric(during, "gateway_websocket_open") == metric(before, "gateway_websocket_open") + 1
    assert metric(after, "gateway_websocket_open") == metric(before, "gateway_websocket_open")
    assert metric(after, "gateway_websocket_closed_total", reason="client") == closed_before + 1
    errors = "gateway_websocket_error_events_total"
    assert metric(after, errors, code="invalid_json") == metric(before, errors, code="invalid_json") + 1
    requests = "gateway_requests_total"
    assert metric(after, requests, route="responses_ws") == metric(before, requests, route="responses_ws") + 1
    assert metric(after, "gateway_websocket_turns_per_socket_count") == (
        metric(before, "gateway_websocket_turns_per_socket_count") + 1
    )
