"""The engine counts exactly one live request for a gateway stream, over every engine protocol: from the
first token to the last, then none; and none after a client that leaves mid-stream (the Abort frees it).

Routing on engine-reported load (`active_requests`, pushed loads) depends on this count. The simulated
engine holds each stream at token counts the test chooses (`RunningSim.hold(after_tokens=...)`), so every
reading is taken while the engine provably has not finished: no timing decides what a reading must be.
`/generate` streams carry the running completion count, which tells the test where the engine stands.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from harmony_gateway.sim.server import EngineKind
from tests.conftest import MODEL
from tests.support.servers import client_request_id, running_gateway, test_settings, wait_until

ENGINES: tuple[EngineKind, ...] = ("sglang", "vllm", "mlx", "trtllm", "tokenspeed")
#: Tokens the simulated model answers with; the holds sit at the first, the middle and the last but one.
ANSWER_TOKENS = 300
CHECKPOINTS = (1, ANSWER_TOKENS // 2, ANSWER_TOKENS - 1)
PROMPT = "<|start|>user<|message|>hello<|end|><|start|>assistant"


def generate_body() -> dict[str, object]:
    return {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 2 * ANSWER_TOKENS, "temperature": 0},
        "stream": True,
    }


async def completion_counts(response: httpx.Response) -> AsyncIterator[tuple[int, bool]]:
    """(completion tokens so far, finished) of each message of a `/generate` stream."""
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            meta = json.loads(line[6:])["meta_info"]
            yield meta["completion_tokens"], meta["finish_reason"] is not None


@pytest.fixture(params=ENGINES)
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[RunningSim]:
    async with await start_sim_engine(
        SimConfig(engine=request.param, model=MODEL, output_tokens=ANSWER_TOKENS)
    ) as sim:
        yield sim


async def test_one_live_request_from_first_to_last_token_then_none(engine: RunningSim) -> None:
    async with (
        running_gateway(test_settings(worker_urls=(engine.url,))) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        readings: list[tuple[int, int]] = []
        points = list(CHECKPOINTS)
        engine.hold(after_tokens=points[0])
        last = (0, False)
        async with http.stream("POST", "/generate", json=generate_body()) as response:
            assert response.status_code == 200
            async for last in completion_counts(response):
                tokens = last[0]
                if points and tokens >= points[0]:
                    # The engine waits at this point until released: its request cannot have ended.
                    readings.append((tokens, engine.active_requests))
                    engine.release_held()
                    points.pop(0)
                    if points:
                        engine.hold(after_tokens=points[0])
        assert last == (ANSWER_TOKENS, True)
        await wait_until(lambda: engine.active_requests == 0, timeout=10)
    assert readings == [(point, 1) for point in CHECKPOINTS]
    assert engine.peak_active == 1  # never a second call for the same stream
    assert len(engine.requests) == 1 and engine.aborted == []  # no Abort for an answer that finished


async def test_a_client_that_leaves_mid_stream_frees_the_engine_request(engine: RunningSim) -> None:
    async with (
        running_gateway(test_settings(worker_urls=(engine.url,))) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        engine.hold(after_tokens=ANSWER_TOKENS // 2)
        try:
            async with http.stream(
                "POST", "/generate", json=generate_body(), headers={"x-request-id": "leaves-mid-stream"}
            ) as response:
                async for tokens, _ in completion_counts(response):
                    if tokens >= ANSWER_TOKENS // 2:
                        held = engine.active_requests
                        break  # leave while the engine holds the rest of the answer
            assert held == 1
            await wait_until(lambda: engine.active_requests == 0, timeout=10)
        finally:
            engine.release_held()
    (request,) = engine.requests
    assert client_request_id(request.request_id) == "leaves-mid-stream"
    assert engine.aborted == [request.request_id]
    assert engine.peak_active == 1
