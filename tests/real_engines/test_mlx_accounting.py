"""The real MLX servicer counts a gateway stream as exactly one live request (`GetServerInfo.
active_requests`) from its first token to its last, and as none once it ended or its client left.

What the servicer counts: a Generate call from the moment the generation thread admitted it until its
handler exits, which is when it has sent its `GenerateComplete` or taken an Abort or a cancellation. It
generates ahead of a slow reader (nothing in it waits for the client), so once its answer is complete it
reads 0 even while the gateway still relays the tail of that answer: the count follows the engine's work,
not the client's reading. The readings here are taken on a channel of their own, straight to the
servicer, at points of the stream itself (after its first token, then every so many tokens); each test
says why a reading at that point must be what it asserts, with no timing involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import mlx_engine_pb2 as pb
from smg_grpc_proto.generated import mlx_engine_pb2_grpc as pb_grpc

from harmony_gateway.engines.base import SamplingOptions
from harmony_gateway.harmony.encoding import ASSISTANT_STOP_IDS, get_encoding
from harmony_gateway.pipeline.context import PreparedRequest, RequestContext
from harmony_gateway.pipeline.dispatch import dispatch
from tests.real_engines.test_mlx_conformance import ABORT, GENERATE
from tests.support.real_engines import EngineProcess, RecordedCall, RecordingProxy
from tests.support.servers import RunningGateway, client_request_id

#: A prompt the tiny model never stops answering (no stop token comes), so `max_new_tokens` decides the
#: engine's length; the issue this guards against was seen on a 1,961-token answer.
ENDLESS_PROMPT = "hello"
LONG_ANSWER = 1961

Active = Callable[[], Awaitable[int]]


@pytest.fixture
async def active(mlx_engine: EngineProcess) -> AsyncIterator[Active]:
    """`active_requests` as the servicer reports it, read on a channel the gateway does not share."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{mlx_engine.port}")
    stub = pb_grpc.MlxEngineStub(channel)

    async def read() -> int:
        reply = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
        return int(reply.active_requests)

    try:
        yield read
    finally:
        await channel.close()


async def settled(active: Active, timeout: float = 10.0) -> int:
    """The servicer's count once it reads 0 (its handler's clean-up runs just after the call's last
    message), or its last reading after `timeout` seconds."""
    value = await active()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while value:
                await asyncio.sleep(0.05)  # polling a process we do not control; no event to wait on
                value = await active()
    return value


def generate_body(max_new_tokens: int) -> dict[str, object]:
    return {
        "text": ENDLESS_PROMPT,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "stream": True,
    }


async def completion_counts(response: httpx.Response) -> AsyncIterator[tuple[int, bool]]:
    """(completion tokens so far, finished) of each message of a `/generate` stream."""
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            meta = json.loads(line[6:])["meta_info"]
            yield meta["completion_tokens"], meta["finish_reason"] is not None


def calls_of(proxy: RecordingProxy, method: str, request_id: str) -> list[RecordedCall]:
    """The engine calls of one client request (its engine ids start with the client's id)."""
    found = []
    for call in proxy.calls:
        if call.method == GENERATE and method == GENERATE:
            ids = [pb.GenerateRequest.FromString(call.request).request_id]
        elif call.method == ABORT and method == ABORT:
            ids = list(pb.AbortRequest.FromString(call.request).request_ids)
        else:
            continue
        if any(client_request_id(i) == request_id for i in ids):
            found.append(call)
    return found


def reply_kinds(call: RecordedCall) -> list[str]:
    return [str(pb.GenerateResponse.FromString(r).WhichOneof("response")) for r in call.responses]


@pytest.mark.timeout(300)
async def test_one_live_request_for_the_whole_of_a_long_stream_and_none_once_the_client_left(
    mlx_gateway: RunningGateway, mlx_proxy: RecordingProxy, active: Active
) -> None:
    # The engine is asked for far more than the client reads, and the client leaves after 1,961 tokens:
    # the engine cannot have finished the answer on its own (checked below), so until the client leaves
    # its Generate call is live and every reading must be 1.
    request_id = "mlx-accounting-long"
    readings: list[tuple[int, int]] = []
    next_reading = 1
    async with httpx.AsyncClient(base_url=mlx_gateway.url, timeout=120) as http:
        async with http.stream(
            "POST", "/generate", json=generate_body(4 * LONG_ANSWER), headers={"x-request-id": request_id}
        ) as response:
            assert response.status_code == 200
            async for tokens, finished in completion_counts(response):
                assert not finished
                if tokens >= next_reading:
                    readings.append((tokens, await active()))
                    next_reading = (tokens // 100 + 1) * 100
                if tokens >= LONG_ANSWER:
                    break  # the client leaves mid-answer
    after = await settled(active)

    (generate,) = calls_of(mlx_proxy, GENERATE, request_id)  # one engine call for the whole stream
    (abort,) = await mlx_proxy.wait_for(lambda: calls_of(mlx_proxy, ABORT, request_id) or None)
    await asyncio.wait_for(abort.done.wait(), 10)
    await asyncio.wait_for(generate.done.wait(), 10)
    kinds = reply_kinds(generate)
    assert "complete" not in kinds  # cut by the Abort: the engine never finished it itself
    assert kinds.count("chunk") >= LONG_ANSWER
    assert abort.code is not None and abort.code.name == "OK"
    assert len(readings) >= LONG_ANSWER // 100
    assert [value for _, value in readings] == [1] * len(readings), readings
    assert after == 0  # the Abort freed it


async def test_a_stream_that_ends_is_one_request_until_its_engine_finishes_then_none(
    mlx_gateway: RunningGateway, mlx_proxy: RecordingProxy, active: Active
) -> None:
    # The engine generates ahead of the client, so near the end a reading may already be 0 (the engine
    # sent its whole answer); the count must never rise again, never reach 2, and end at 0, with one
    # Generate call that ran to its own Complete and no Abort.
    request_id = "mlx-accounting-ends"
    answer = 300
    readings: list[int] = []
    last = (0, False)
    async with httpx.AsyncClient(base_url=mlx_gateway.url, timeout=120) as http:
        async with http.stream(
            "POST", "/generate", json=generate_body(answer), headers={"x-request-id": request_id}
        ) as response:
            assert response.status_code == 200
            async for last in completion_counts(response):
                if last[0] == 1 or last[0] % 50 == 0:
                    readings.append(await active())
    assert last == (answer, True)
    after = await settled(active)

    (generate,) = calls_of(mlx_proxy, GENERATE, request_id)
    await asyncio.wait_for(generate.done.wait(), 10)
    assert reply_kinds(generate) == ["chunk"] * answer + ["complete"]
    assert calls_of(mlx_proxy, ABORT, request_id) == []
    assert readings[0] == 1, readings  # the first token is out, 299 more are to come
    assert set(readings) <= {0, 1} and readings == sorted(readings, reverse=True), readings
    assert after == 0


async def test_each_generation_of_one_request_is_its_own_engine_request(
    mlx_gateway: RunningGateway, mlx_proxy: RecordingProxy, tiny_model: Path, active: Active
) -> None:
    # A Responses tool loop generates again on the same worker for the same request, right after the
    # previous generation ended. The servicer cleans a call up after its handler exited, on its
    # generation thread, by request id: a next call under the same id was cut before its first token.
    state = mlx_gateway.state
    group = state.fleet.group(str(tiny_model))
    prepared = PreparedRequest(
        group=group,
        input_ids=get_encoding().encode("x", allowed_special="all"),
        sampling=SamplingOptions(temperature=0.0, max_new_tokens=32, stop_token_ids=list(ASSISTANT_STOP_IDS)),
        selection_text="",
        stream=True,
    )
    ctx = RequestContext(request_id="mlx-accounting-turns", route="test")
    finishes = []
    for _ in range(4):
        chunks = dispatch(state, prepared, ctx, stream=True, pinned=ctx.worker)
        async with contextlib.aclosing(chunks):
            finishes += [chunk.finish_reason async for chunk in chunks if chunk.finished]
    assert finishes == ["stop"] * 4

    calls = calls_of(mlx_proxy, GENERATE, ctx.request_id)
    ids = [pb.GenerateRequest.FromString(call.request).request_id for call in calls]
    assert len(set(ids)) == len(ids) == 4
    for call in calls:
        await asyncio.wait_for(call.done.wait(), 10)
        assert reply_kinds(call)[-1] == "complete"
    assert await settled(active) == 0
