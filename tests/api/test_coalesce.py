"""coalesce: same bytes in the same order, pieces joined only while the writer is busy, errors raised after
what came before, and closing it cancels the source and waits for the source's cleanup."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from harmony_gateway.api.coalesce import coalesce


async def pieces(n: int, *, pause: bool = False) -> AsyncIterator[bytes]:
    for i in range(n):
        if pause:
            await asyncio.sleep(0)
        yield b"%d;" % i


async def test_same_bytes_in_order_and_bursts_joined() -> None:
    out = []
    async for chunk in coalesce(pieces(50)):
        out.append(chunk)
        await asyncio.sleep(0.001)  # a slow writer: the source runs ahead
    assert b"".join(out) == b"".join(b"%d;" % i for i in range(50))
    assert len(out) < 50


async def test_backpressure_bounds_what_waits() -> None:
    out = []
    async for chunk in coalesce(pieces(100, pause=True), max_pending=4):
        out.append(chunk)
        await asyncio.sleep(0.001)
    assert b"".join(out) == b"".join(b"%d;" % i for i in range(100))
    assert max(chunk.count(b";") for chunk in out) <= 4


async def test_error_is_raised_after_what_came_before() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"a"
        raise ValueError("boom")

    got = []
    with pytest.raises(ValueError, match="boom"):
        async for chunk in coalesce(failing()):
            got.append(chunk)
    assert got == [b"a"]


async def test_close_cancels_the_source_and_waits_for_its_cleanup() -> None:
    cleaned = asyncio.Event()

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                await asyncio.sleep(0.001)
                yield b"x"
        finally:
            await asyncio.sleep(0.01)  # e.g. the engine abort
            cleaned.set()

    stream = coalesce(endless())
    assert await anext(stream) == b"x"
    await stream.aclose()
    assert cleaned.is_set()


async def test_close_while_the_source_waits_for_room_still_closes_the_source() -> None:
    """A slow client that leaves while the source is held back (max_pending reached) must still get the
    source closed, so the engine request is aborted before the close returns."""
    cleaned = asyncio.Event()

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"x"
        finally:
            await asyncio.sleep(0.01)  # e.g. the engine abort
            cleaned.set()

    stream = coalesce(endless(), max_pending=2)
    assert (await anext(stream)).startswith(b"x")
    await asyncio.sleep(0.01)  # the source fills the pending pieces and waits for room
    await stream.aclose()
    assert cleaned.is_set()
