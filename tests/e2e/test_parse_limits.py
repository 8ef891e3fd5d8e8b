"""`POST /v1/harmony/parse` is bounded and off the event loop (issue: 20,000 `<|start|>` took 8.7 s and blocked
`/health` for as long; 65k took 150 s): its input is capped at `max_parse_tokens` ids (a 400 naming
`token_ids` beyond), parsing is linear, and the largest allowed parse runs in a worker thread while `/health`
keeps answering."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim
from tests.support.loop_stall import health_while
from tests.support.servers import RunningGateway, running_gateway, test_settings

START = 200006
MAX_PARSE_TOKENS = test_settings().max_parse_tokens
# The costliest shape found for the parser: every message's header is rejected, so each one is a recovery.
WORST = get_encoding().encode("<|start|>x y z<|message|>", allowed_special="all")


@pytest.fixture(scope="module")
async def gateway(sim: RunningSim) -> AsyncIterator[RunningGateway]:
    async with running_gateway(test_settings(worker_urls=(sim.url,))) as gw:
        yield gw


@pytest.fixture
async def http(gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
        yield client


async def _parse(http: httpx.AsyncClient, token_ids: list[int]) -> tuple[httpx.Response, float]:
    body = orjson.dumps({"token_ids": token_ids})  # encoded before the clock (and the loop) start
    start = time.perf_counter()
    response = await http.post(
        "/v1/harmony/parse", content=body, headers={"content-type": "application/json"}
    )
    return response, time.perf_counter() - start


async def test_twenty_thousand_start_tokens_parse_quickly(http: httpx.AsyncClient) -> None:
    response, took = await _parse(http, [START] * 20_000)
    assert response.status_code == 200, response.text
    assert response.json()["recoveries"][0]["kind"] == "not_harmony"
    assert took < 5, took  # 8.7 s before, on a faster machine than a loaded CI runner
    response, took = await _parse(http, [START] * 65_536)
    assert response.status_code == 200
    assert took < 10, took  # 150 s before


async def test_more_ids_than_allowed_are_a_400_naming_token_ids(http: httpx.AsyncClient) -> None:
    response, _ = await _parse(http, [START] * (MAX_PARSE_TOKENS + 1))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["type"]) == ("token_ids", "invalid_request_error")
    assert str(MAX_PARSE_TOKENS) in error["message"]
    text = "<|start|>" * MAX_PARSE_TOKENS * 2
    response = await http.post("/v1/harmony/parse", json={"text": text})
    assert response.status_code == 400 and response.json()["error"]["param"] == "text"
    response, _ = await _parse(http, [START] * MAX_PARSE_TOKENS)
    assert response.status_code == 200


async def test_a_configured_cap_is_the_limit(sim: RunningSim) -> None:
    settings = test_settings(worker_urls=(sim.url,), max_parse_tokens=10)
    async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        assert (await _parse(http, [1] * 10))[0].status_code == 200
        response, _ = await _parse(http, [1] * 11)
        assert response.status_code == 400 and response.json()["error"]["param"] == "token_ids"


@pytest.mark.parametrize("shape", ["start run", "rejected headers"])
async def test_the_largest_allowed_parse_never_stalls_the_event_loop(
    http: httpx.AsyncClient, shape: str
) -> None:
    unit = [START] if shape == "start run" else WORST
    token_ids = (unit * (MAX_PARSE_TOKENS // len(unit) + 1))[:MAX_PARSE_TOKENS]
    body = orjson.dumps({"token_ids": token_ids})
    parse = http.post("/v1/harmony/parse", content=body, headers={"content-type": "application/json"})
    stall = await health_while(http, parse)
    assert stall.response.status_code == 200, stall.response.text
    assert stall.took < 30, stall.took  # linear: about a second of CPU on an idle machine
    assert len(stall.latencies) >= 20
    assert stall.p99 < 0.05, (stall.p99, stall.latencies[-5:], len(stall.latencies))
