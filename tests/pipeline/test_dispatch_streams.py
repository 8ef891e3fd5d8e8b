"""dispatch's stream helpers close the engine stream they wrap when their consumer stops, so the gRPC
call is cancelled then, not whenever the garbage collector finalises it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from harmony_gateway.engines.base import EngineChunk
from harmony_gateway.pipeline.dispatch import _first_then_rest


async def test_leaving_after_the_first_chunk_closes_the_engine_stream() -> None:
    closed: list[bool] = []

    async def engine() -> AsyncIterator[EngineChunk]:
        try:
            yield EngineChunk(0, [1])
            yield EngineChunk(0, [2])
        finally:
            closed.append(True)  # the engine client cancels its gRPC call here

    chunks = _first_then_rest(engine(), 5.0, "grpc://w")
    assert (await anext(chunks)).token_ids == [1]
    await chunks.aclose()
    assert closed == [True]


async def test_leaving_mid_stream_closes_the_engine_stream() -> None:
    closed: list[bool] = []

    async def engine() -> AsyncIterator[EngineChunk]:
        try:
            for i in range(5):
                yield EngineChunk(0, [i])
        finally:
            closed.append(True)

    chunks = _first_then_rest(engine(), 5.0, "grpc://w")
    await anext(chunks)
    await anext(chunks)
    await chunks.aclose()
    assert closed == [True]
