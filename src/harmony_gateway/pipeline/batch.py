"""Several engine requests for one client request (a `/generate` or `/v1/completions` prompt list): at
most `batch_concurrency` of them at the engines at once, their chunks merged in arrival order.

Each sub-request runs as a task under a semaphore, on its own child context (request id
`<id>-<index>`, its own clean-ups), so a batch never holds more than a bounded share of the engines'
slots and a waiting sub-request has not reached any engine. `open()` waits for the first chunk of every
sub-request of the first wave, so failures before any output are HTTP errors; a sub-request of a later
wave that fails is a failure of the stream. On any exit (a failure, the consumer stopping, the client
leaving) `aclose()` cancels every task: those at an engine abort there (`dispatch` sends `Abort`), those
waiting never start. A sibling cancelled this way is not a failure of its worker, so it never counts
towards a circuit breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio

from ..engines.base import EngineChunk
from .context import CLEANUP_TIMEOUT, GatewayState, PreparedRequest, RequestContext, engine_request_id

#: How many chunks the sub-requests may have queued before the slowest consumer holds them back.
QUEUE_SIZE = 64

#: Opens one engine stream, its first chunk taken (`drive.open_generation`).
Opener = Callable[[GatewayState, PreparedRequest, RequestContext], Awaitable[AsyncIterator[EngineChunk]]]

_END = object()


def child_context(ctx: RequestContext, index: int, count: int) -> RequestContext:
    """The context of sub-request `index`: its own request id when there are several, its own clean-ups
    and worker either way (the parent's clean-up closes the whole batch, never one stream twice)."""
    if count == 1:
        request_id, engine_id = ctx.request_id, ctx.engine_id
    else:
        request_id = f"{ctx.request_id}-{index}"
        engine_id = engine_request_id(request_id)
    return dataclasses.replace(
        ctx,
        request_id=request_id,
        engine_id=engine_id,
        engine_calls=0,
        log_extra={},
        cleanups=[],
        worker=None,
        prefill_worker=None,
    )


class Batch:
    """The engine requests of one client request; see the module docstring. Not reusable."""

    def __init__(
        self,
        state: GatewayState,
        ctx: RequestContext,
        prepared: list[PreparedRequest],
        opener: Opener,
        *,
        concurrency: int,
    ) -> None:
        self.ctx = ctx
        self.prepared = prepared
        self.children = [child_context(ctx, i, len(prepared)) for i in range(len(prepared))]
        self._state = state
        self._opener = opener
        self._limit = max(1, concurrency)
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue(maxsize=QUEUE_SIZE)
        self._buffer: list[tuple[int, object]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._remaining = len(prepared)
        self._failed = False

    async def open(self) -> None:
        """Start every sub-request (at most `concurrency` run at once) and wait until each of the first
        wave sent its first chunk or ended. Raises the first failure, with everything closed."""
        semaphore = asyncio.Semaphore(self._limit)
        self._tasks = [
            asyncio.create_task(self._run(i, semaphore), name=f"batch-{self.children[i].request_id}")
            for i in range(len(self.prepared))
        ]
        waiting = set(range(min(self._limit, len(self.prepared))))
        try:
            while waiting:
                i, item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                self._buffer.append((i, item))
                waiting.discard(i)
        except BaseException:
            await self.aclose()
            raise

    async def _run(self, i: int, semaphore: asyncio.Semaphore) -> None:
        child = self.children[i]
        try:
            async with semaphore:
                if self._failed:
                    return  # a sibling failed: the batch is over, start nothing more
                try:
                    chunks = await self._opener(self._state, self.prepared[i], child)
                    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                        async for chunk in chunks:
                            await self._queue.put((i, chunk))
                except Exception as exc:
                    self._failed = True  # before the slot is free
                    await self._queue.put((i, exc))
                    return
        finally:
            if self.ctx.first_token_at is None and child.first_token_at is not None:
                self.ctx.first_token_at = child.first_token_at
            self.ctx.retries += child.retries
        await self._queue.put((i, _END))

    async def source(self) -> AsyncIterator[tuple[int, EngineChunk]]:
        """`open`, then `chunks`: a `drive.Generation`'s source."""
        await self.open()
        return self.chunks()

    async def chunks(self) -> AsyncIterator[tuple[int, EngineChunk]]:
        """Every sub-request's chunks as they arrive, tagged with its index; the first failure is raised.
        Closing the iterator closes the batch."""
        try:
            for i, item in self._buffer:
                if item is _END:
                    self._remaining -= 1
                else:
                    yield i, item  # type: ignore[misc]
            self._buffer.clear()
            while self._remaining:
                i, item = await self._queue.get()
                if item is _END:
                    self._remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item  # type: ignore[misc]
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Cancel every sub-request and wait for them (their engine aborts are shielded). Idempotent."""
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            # Shielded: a consumer cancelled by its client leaving still waits for the aborts.
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT):
                await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["Batch", "child_context"]
