"""`/v1/completions` and `/generate` prompt lists against the real gateway and the gRPC sim: capped (400
naming the param), a bounded number of sub-requests at the engine at once, everything aborted at the
engine when the batch fails or its client leaves, and no circuit breaker opened by a client's own batch."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import openai
import pytest

from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.servers import RunningGateway, running_gateway, test_settings, wait_until

CONCURRENCY = 3


@pytest.fixture(scope="module")
async def paced_sim() -> AsyncIterator[RunningSim]:
    async with await start_sim_engine(SimConfig(model=MODEL, tokens_per_second=400)) as engine:
        yield engine


@pytest.fixture(scope="module")
async def batch_gateway(paced_sim: RunningSim) -> AsyncIterator[RunningGateway]:
    settings = test_settings(
        worker_urls=(paced_sim.url,), max_batch_size=16, batch_concurrency=CONCURRENCY, max_retries=0
    )
    async with running_gateway(settings) as gw:
        yield gw


@pytest.fixture
async def http(batch_gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=batch_gateway.url, timeout=30) as c:
        yield c


def _worker(gw: RunningGateway) -> Any:
    (worker,) = gw.state.fleet.all_workers()
    return worker


def _peak_admissions(sim: RunningSim) -> list[int]:
    """Records, at each Generate the sim admits, how many requests it then has in flight."""
    core = sim._core
    peaks: list[int] = []
    admit = core.admit

    def counting(received: Any) -> Any:
        run = admit(received)
        peaks.append(core.active)
        return run

    core.admit = counting
    return peaks


def _long(text: str) -> str:
    """A raw Harmony prompt the sim answers with a ~400-token analysis."""
    return f"<|start|>user<|message|>[[long]] {text}<|end|><|start|>assistant"


async def _settled(gw: RunningGateway, sim: RunningSim) -> None:
    await wait_until(lambda: sim.active_requests == 0 and _worker(gw).in_flight == 0, timeout=10)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ["hi"] * 17}, "prompt"),
        ("/v1/completions", {"prompt": ["hi"] * 5, "n": 4}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2]] * 100_000}, "prompt"),
        ("/generate", {"text": ["hi"] * 17}, "text"),
        ("/generate", {"input_ids": [[1, 2]] * 10_000}, "input_ids"),
        ("/generate", {"text": ["hi"] * 9, "sampling_params": {"n": 2}}, "text"),
    ],
)
async def test_a_batch_above_the_cap_is_a_400_naming_the_param(
    http: httpx.AsyncClient, paced_sim: RunningSim, path: str, body: dict[str, Any], param: str
) -> None:
    before = len(paced_sim.requests)
    started = time.monotonic()
    r = await http.post(path, json={"model": MODEL, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "at most 16" in error["message"]
    assert time.monotonic() - started < 5
    assert len(paced_sim.requests) == before  # refused before any engine request


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [[]]}, "prompt"),
        ("/v1/completions", {"prompt": [[1], []]}, "prompt[1]"),
        ("/generate", {"text": []}, "text"),
        ("/generate", {"input_ids": []}, "input_ids"),
        ("/generate", {"input_ids": [[]]}, "input_ids[0]"),
    ],
)
async def test_empty_batches_and_prompts_are_400s(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    r = await http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_sub_requests_are_bounded_and_every_prompt_is_answered(
    batch_gateway: RunningGateway, paced_sim: RunningSim
) -> None:
    peaks = _peak_admissions(paced_sim)
    try:
        async with openai.AsyncOpenAI(base_url=batch_gateway.base_url, api_key="k", max_retries=0) as c:
            prompts = [
                f"<|start|>user<|message|>prompt number {i}<|end|><|start|>assistant" for i in range(8)
            ]
            done = await c.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=24)
            streamed = await c.completions.create(
                model=MODEL, prompt=prompts, n=2, max_tokens=24, stream=True
            )
            texts: dict[int, str] = {}
            async for chunk in streamed:
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
    finally:
        del paced_sim._core.admit
    assert len(peaks) == 16
    assert max(peaks) == CONCURRENCY  # bounded, and the bound is used
    assert sorted(choice.index for choice in done.choices) == list(range(16))
    assert {choice.index: choice.text for choice in done.choices} == texts
    assert done.usage is not None and done.usage.completion_tokens == 16 * 24
    assert all(choice.text for choice in done.choices)
    await _settled(batch_gateway, paced_sim)


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
async def test_a_client_leaving_a_streamed_batch_aborts_it_at_the_engine(
    batch_gateway: RunningGateway, paced_sim: RunningSim, http: httpx.AsyncClient, path: str
) -> None:
    before = len(paced_sim.requests)
    body: dict[str, Any] = {"model": MODEL, "stream": True}
    prompts = [_long(f"leaving {path} {i}") for i in range(12)]
    if path == "/generate":
        body |= {"text": prompts, "sampling_params": {"max_new_tokens": 300}}
    else:
        body |= {"prompt": prompts, "max_tokens": 300}
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen == 5:
                break  # the client leaves with the first wave still generating
    await _settled(batch_gateway, paced_sim)
    started = [req.request_id for req in paced_sim.requests[before:]]
    assert CONCURRENCY <= len(started) < len(prompts)  # the waiting sub-requests never reached it
    assert set(started) <= set(paced_sim.aborted)
    assert _worker(batch_gateway).breaker.value == "closed"


async def test_a_failing_sub_request_aborts_its_siblings_and_a_clients_batch_opens_no_breaker(
    batch_gateway: RunningGateway, paced_sim: RunningSim, http: httpx.AsyncClient
) -> None:
    worker = _worker(batch_gateway)
    threshold = batch_gateway.state.settings.breaker_failure_threshold
    for attempt in range(threshold + 1):
        before = len(paced_sim.requests)
        # The engine refuses one sub-request as invalid: the client's own request. A streamed engine
        # request fails at once; a non-stream one only when its output would be complete.
        stream = attempt % 2 == 0
        paced_sim.fail_next(grpc.StatusCode.INVALID_ARGUMENT, message="bad sampling")
        r = await http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": [_long(f"fail {attempt} {i}") for i in range(6)],
                "max_tokens": 300,
                "stream": stream,
            },
        )
        assert r.status_code == 400, r.text  # before any byte of the stream
        assert "bad sampling" in r.json()["error"]["message"]
        await _settled(batch_gateway, paced_sim)
        started = [req.request_id for req in paced_sim.requests[before:]]
        if stream:
            assert len(started) == CONCURRENCY  # the later wave never started
            # The siblings, aborted at the engine (the sim admits in order: the first one failed).
            assert set(started[1:]) <= set(paced_sim.aborted)
        assert worker.breaker.value == "closed" and worker.breaker_failures == 0

    # A worker failure counts once for the batch, not once per sibling it took down.
    paced_sim.fail_next(grpc.StatusCode.UNAVAILABLE, message="engine fell over")
    r = await http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": [_long(f"down {i}") for i in range(6)],
            "max_tokens": 300,
            "stream": True,
        },
    )
    assert r.status_code == 503, r.text
    await _settled(batch_gateway, paced_sim)
    assert worker.breaker_failures == 1 and worker.breaker.value == "closed"
    ok = await http.post("/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 4})
    assert ok.status_code == 200 and worker.breaker_failures == 0


async def test_a_sub_request_failing_mid_stream_ends_the_stream_with_an_error_and_aborts_the_rest(
    batch_gateway: RunningGateway, paced_sim: RunningSim, http: httpx.AsyncClient
) -> None:
    before = len(paced_sim.requests)
    paced_sim.fail_next(grpc.StatusCode.INTERNAL, after_tokens=20, message="engine crashed")
    body = {
        "model": MODEL,
        "prompt": [_long(f"crash {i}") for i in range(6)],
        "max_tokens": 300,
        "stream": True,
    }
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        frames = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    error = json.loads(frames[-2])["error"]  # the OpenAI stream's error event, then [DONE]
    assert frames[-1] == "[DONE]" and "engine crashed" in error["message"]
    await _settled(batch_gateway, paced_sim)
    started = [req.request_id for req in paced_sim.requests[before:]]
    assert len(started) == CONCURRENCY and set(started) <= set(paced_sim.aborted)
