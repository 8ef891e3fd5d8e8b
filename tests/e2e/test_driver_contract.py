"""Every API surface, stream and non-stream, through the failure paths of a generation, against the real
gateway and the gRPC sim: the engine dying before and after the first token, the client leaving, a
first-token timeout and output that is not Harmony. Each must end with its wire's error (an HTTP status
before the first byte; the wire's terminal error event after), the engine request aborted (the sim
records aborts), the request counted in the metrics with that status, and nothing stored that should
not be. A new surface joins by adding a row to `SURFACES`."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest

from harmony_gateway.settings import Timeouts
from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.servers import (
    RunningGateway,
    client_request_ids,
    running_gateway,
    test_settings,
    wait_until,
)


def _harmony(text: str) -> str:
    return f"<|start|>user<|message|>{text}<|end|><|start|>assistant"


def _sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def _openai_stream_error(text: str) -> bool:
    """Chat Completions, completions and /generate: an `error` object, then `[DONE]`."""
    data = _sse_data(text)
    return len(data) >= 2 and data[-1] == "[DONE]" and "error" in json.loads(data[-2])


def _responses_stream_error(text: str) -> bool:
    data = _sse_data(text)
    return bool(data) and json.loads(data[-1])["type"] == "response.failed"


def _messages_stream_error(text: str) -> bool:
    events = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    return bool(events) and events[-1] == "error"


@dataclass(frozen=True)
class Surface:
    name: str
    path: str
    route: str
    body: Callable[[str, bool], dict[str, Any]]
    stream_error: Callable[[str], bool]
    #: Whether the surface parses Harmony (non-Harmony output is then a failure, not raw text).
    parses: bool = True
    #: The wire's own statuses where they differ from OpenAI's (Anthropic: 529 for overloaded).
    statuses: tuple[tuple[int, int], ...] = ()
    #: Whether it streams when asked; a surface that does not is tried with JSON bodies only.
    streams: bool = True

    def status(self, code: int) -> int:
        return dict(self.statuses).get(code, code)


SURFACES = [
    Surface(
        "chat",
        "/v1/chat/completions",
        "chat",
        lambda text, stream: {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
        },
        _openai_stream_error,
    ),
    Surface(
        "responses",
        "/v1/responses",
        "responses",
        lambda text, stream: {"model": MODEL, "input": text, "stream": stream},
        _responses_stream_error,
    ),
    Surface(
        "responses_compact",
        "/v1/responses/compact",
        "responses_compact",
        # The conversation to compact; the sim reads its triggers from the message before the request
        # for a summary.
        lambda text, stream: {"model": MODEL, "input": [{"role": "user", "content": text}]},
        _responses_stream_error,
        streams=False,
    ),
    Surface(
        "messages",
        "/v1/messages",
        "messages",
        lambda text, stream: {
            "model": MODEL,
            "max_tokens": 1000,
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
        },
        _messages_stream_error,
        statuses=((503, 529),),
    ),
    Surface(
        "completions",
        "/v1/completions",
        "completions",
        lambda text, stream: {"model": MODEL, "prompt": _harmony(text), "max_tokens": 1000, "stream": stream},
        _openai_stream_error,
        parses=False,
    ),
    Surface(
        "generate",
        "/generate",
        "generate",
        lambda text, stream: {
            "text": _harmony(text),
            "sampling_params": {"max_new_tokens": 1000},
            "stream": stream,
        },
        _openai_stream_error,
        parses=False,
    ),
]
CASES = [
    pytest.param(s, stream, id=f"{s.name}-{'stream' if stream else 'json'}")
    for s in SURFACES
    for stream in ((False, True) if s.streams else (False,))
]
STREAMING = [s for s in SURFACES if s.streams]


@pytest.fixture(scope="module")
async def paced() -> AsyncIterator[RunningSim]:
    async with await start_sim_engine(SimConfig(model=MODEL, tokens_per_second=300)) as engine:
        yield engine


@pytest.fixture(scope="module")
async def gw(paced: RunningSim) -> AsyncIterator[RunningGateway]:
    # The failures here are injected one after another: the breaker must not take the worker away.
    settings = test_settings(worker_urls=(paced.url,), max_retries=0, breaker_failure_threshold=10_000)
    async with running_gateway(settings) as gateway:
        yield gateway


@pytest.fixture(scope="module")
async def stalling() -> AsyncIterator[RunningSim]:
    async with await start_sim_engine(SimConfig(model=MODEL, ttft_ms=5000)) as engine:
        yield engine


@pytest.fixture(scope="module")
async def impatient(stalling: RunningSim) -> AsyncIterator[RunningGateway]:
    settings = test_settings(
        worker_urls=(stalling.url,),
        max_retries=0,
        timeouts=Timeouts(first_token=0.3),
        # Each timeout blames the worker, and the sim's health probe waits out its first-token delay
        # too: neither may take the only worker away while the surfaces are tried one after another.
        breaker_failure_threshold=10_000,
        health_interval=3600,
    )
    async with running_gateway(settings) as gateway:
        yield gateway


class Finished:
    """The requests the gateway finished (its metrics hook), by request id, with their status."""

    def __init__(self, gateway: RunningGateway) -> None:
        self.statuses: dict[str, tuple[str, int]] = {}
        self._metrics = gateway.state.metrics
        observe = self._metrics.observe

        def observing(ctx: Any) -> None:
            self.statuses[ctx.request_id] = (ctx.route, ctx.status)
            observe(ctx)

        self._metrics.observe = observing

    def close(self) -> None:
        del self._metrics.observe


@pytest.fixture
async def finished(gw: RunningGateway) -> AsyncIterator[Finished]:
    f = Finished(gw)
    yield f
    f.close()


def _stored(gateway: RunningGateway) -> int:
    return len(gateway.state.store._responses)


async def _call(
    gateway: RunningGateway, surface: Surface, text: str, stream: bool, request_id: str
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
        return await http.post(
            surface.path, json=surface.body(text, stream), headers={"x-request-id": request_id}
        )


async def _ends(gateway: RunningGateway, finished: Finished, request_id: str) -> tuple[str, int]:
    await wait_until(lambda: request_id in finished.statuses, timeout=10)
    return finished.statuses[request_id]


@pytest.mark.parametrize(("surface", "stream"), CASES)
async def test_engine_dies_before_the_first_token(
    gw: RunningGateway, paced: RunningSim, finished: Finished, surface: Surface, stream: bool
) -> None:
    request_id = f"contract-{uuid.uuid4().hex}"
    stored = _stored(gw)
    paced.fail_next(grpc.StatusCode.UNAVAILABLE, after_tokens=0, message="engine died")
    r = await _call(gw, surface, f"dies early {request_id}", stream, request_id)
    assert r.status_code == surface.status(503), r.text  # an HTTP error: nothing was sent before it
    assert "engine died" in r.text
    route, status = await _ends(gw, finished, request_id)
    assert route == surface.route and status in (503, surface.status(503))
    assert request_id in client_request_ids(paced.aborted)
    assert _stored(gw) == stored


@pytest.mark.parametrize(("surface", "stream"), CASES)
async def test_engine_dies_after_the_first_token(
    gw: RunningGateway, paced: RunningSim, finished: Finished, surface: Surface, stream: bool
) -> None:
    request_id = f"contract-{uuid.uuid4().hex}"
    stored = _stored(gw)
    paced.fail_next(grpc.StatusCode.INTERNAL, after_tokens=5, message="engine crashed")
    r = await _call(gw, surface, f"[[long]] dies late {request_id}", stream, request_id)
    if stream:
        assert r.status_code == 200
        assert surface.stream_error(r.text), r.text[-600:]
    else:
        assert r.status_code >= 500 and "engine crashed" in r.text, r.text
    route, status = await _ends(gw, finished, request_id)
    assert route == surface.route and status >= 500
    assert request_id in client_request_ids(paced.aborted)
    # A streamed Responses failure is stored as `failed` (its client knows the id); nothing else is.
    assert _stored(gw) == stored + (1 if stream and surface.name == "responses" else 0)


@pytest.mark.parametrize("surface", STREAMING, ids=[s.name for s in STREAMING])
async def test_client_leaves_mid_stream(
    gw: RunningGateway, paced: RunningSim, finished: Finished, surface: Surface
) -> None:
    request_id = f"contract-{uuid.uuid4().hex}"
    stored = _stored(gw)
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        body = surface.body(f"[[long]] leaving {request_id}", True)
        async with http.stream("POST", surface.path, json=body, headers={"x-request-id": request_id}) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()  # held: the client leaves when the block ends, not before
            seen = 0
            async for line in lines:
                seen += line.startswith("data: ")
                if seen == 8:
                    break
    await _ends(gw, finished, request_id)
    await wait_until(lambda: request_id in client_request_ids(paced.aborted), timeout=10)
    assert _stored(gw) == stored


@pytest.mark.parametrize(("surface", "stream"), CASES)
async def test_first_token_timeout(
    impatient: RunningGateway, stalling: RunningSim, surface: Surface, stream: bool
) -> None:
    request_id = f"contract-{uuid.uuid4().hex}"
    probe = Finished(impatient)
    try:
        stored = _stored(impatient)
        r = await _call(impatient, surface, f"slow {request_id}", stream, request_id)
        assert r.status_code == surface.status(504), r.text
        assert await _ends(impatient, probe, request_id) == (surface.route, 504)
    finally:
        probe.close()
    await wait_until(lambda: request_id in client_request_ids(stalling.aborted), timeout=10)
    assert _stored(impatient) == stored


@pytest.mark.parametrize(("surface", "stream"), CASES)
async def test_output_that_is_not_harmony(
    gw: RunningGateway, paced: RunningSim, finished: Finished, surface: Surface, stream: bool
) -> None:
    """Harmony surfaces never pass junk off as an answer (a 502, or the wire's error event once
    streaming); raw surfaces return it as the raw text it is."""
    request_id = f"contract-{uuid.uuid4().hex}"
    stored = _stored(gw)
    r = await _call(gw, surface, f"[[junk]] {request_id}", stream, request_id)
    route, status = await _ends(gw, finished, request_id)
    assert route == surface.route
    if not surface.parses:
        assert r.status_code == 200 and status == 200
        return
    if stream:
        assert r.status_code == 200 and surface.stream_error(r.text), r.text[-600:]
    else:
        assert r.status_code == 502, r.text
    assert status == 502
    assert _stored(gw) == stored + (1 if stream and surface.name == "responses" else 0)
