"""Joins stream pieces produced while the previous one was being written, so a burst of engine messages
becomes one socket write (and one client read) instead of one per token."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import anyio


async def coalesce(stream: AsyncGenerator[bytes, None], max_pending: int = 64) -> AsyncGenerator[bytes, None]:
    """Yield the bytes of `stream`, joining the pieces that arrived while the writer was busy.

    The source runs in a task of its own, at most `max_pending` pieces ahead of the writer (then it
    waits). With nothing pending a piece goes out as soon as it is produced, so latency is unchanged;
    the bytes are the same, only the write boundaries move. An error in the source is raised here
    after what it produced was yielded. Closing this generator (the client went away) cancels the
    source and waits, shielded, for its cleanup, so the engine request is aborted before it returns.
    """
    pending: list[bytes] = []
    wake = asyncio.Event()  # source -> writer: something is pending, or the source ended
    room = asyncio.Event()  # writer -> source: fewer than max_pending pieces wait
    room.set()
    done = False

    async def pump() -> None:
        nonlocal done
        try:
            # Closed here, not left to the garbage collector: cancelled while it waits for room, the
            # source sits at a yield and only aclose() runs its cleanup (the engine abort).
            async with contextlib.aclosing(stream):
                async for piece in stream:
                    pending.append(piece)
                    wake.set()
                    if len(pending) >= max_pending:
                        room.clear()
                        await room.wait()
        finally:
            done = True
            wake.set()

    task = asyncio.create_task(pump())
    try:
        while True:
            if not pending:
                if done:
                    break
                wake.clear()
                await wake.wait()
                continue
            out = pending[0] if len(pending) == 1 else b"".join(pending)
            pending.clear()
            room.set()
            yield out
        await task  # the source's error, if any
    finally:
        if not task.done():
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(task, return_exceptions=True)
