"""Admission: at most `limit` requests running at once (generations, and every route whose
`traffic.routes.RouteCost` takes a slot), `queue_size` more waiting.

Waiters are admitted by priority (higher first), FIFO within a priority. A waiter gains one priority
level per `aging` seconds it has waited, so a busy high-priority class delays a low one but never
starves it; `queue_timeout` bounds every wait anyway. A full queue and a wait past the timeout raise
`RateLimited` with code `queue_full` / `queue_timeout` (HTTP 429 with `retry-after`).

Slots are counted in this process, or, with `serve --workers N`, in a `SharedSlots` file that every
process of the gateway locks byte ranges of: the cap then holds for the gateway as a whole. Byte-range
locks belong to the process, so the kernel frees the slots of a process that dies. Each process still
queues its own waiters (priority holds within a process); a slot another process frees is noticed by
polling every `SHARED_POLL_SECONDS` while someone waits.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from ..errors import RateLimited

log = logging.getLogger(__name__)

SHARED_POLL_SECONDS = 0.02


class SharedSlots:
    """`limit` slots shared by the processes of one gateway: slot i is an exclusive lock on byte i of
    `path`. POSIX locks do not exclude their own process, so the slots this process holds are tracked
    here and never tried again."""

    def __init__(self, path: str, limit: int) -> None:
        self.path = path
        self.limit = limit
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._held: set[int] = set()

    def take(self) -> int | None:
        for index in range(self.limit):
            if index in self._held:
                continue
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, index)
            except OSError:
                continue
            self._held.add(index)
            return index
        return None

    def give(self, index: int) -> None:
        if index in self._held:
            self._held.discard(index)
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, index)

    def close(self) -> None:
        os.close(self._fd)


@dataclass(eq=False)
class _Waiter:
    seq: int
    priority: int
    enqueued: float
    future: asyncio.Future[int]


class Slot:
    """One admitted request's place; `release` is idempotent."""

    __slots__ = ("_admission", "_index", "released", "waited")

    def __init__(self, admission: Admission, index: int, waited: float) -> None:
        self._admission = admission
        self._index = index
        self.waited = waited
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._give(self._index)


class Admission:
    def __init__(
        self,
        limit: int,
        queue_size: int,
        queue_timeout: float,
        *,
        aging: float = 5.0,
        shared: SharedSlots | None = None,
        metrics: Any = None,
    ) -> None:
        self.limit = limit
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.aging = aging
        self.shared = shared
        self.metrics = metrics
        self.in_flight = 0
        self._free_local = limit
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        #: Set while anyone waits, for `poll_shared`.
        self._queued = asyncio.Event()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _take(self) -> int | None:
        if self.shared is not None:
            return self.shared.take()
        if self._free_local > 0:
            self._free_local -= 1
            return 0
        return None

    def _give(self, index: int) -> None:
        self.in_flight -= 1
        if self.shared is not None:
            self.shared.give(index)
        else:
            self._free_local += 1
        self.report()
        self._dispatch()

    def _order(self, waiter: _Waiter, now: float) -> tuple[float, int]:
        # Aging: every `aging` seconds waited counts as one priority level more.
        boost = (now - waiter.enqueued) / self.aging if self.aging > 0 else 0.0
        return (-(waiter.priority + boost), waiter.seq)

    def _dispatch(self) -> None:
        while self._waiters:
            now = time.monotonic()
            best = min(self._waiters, key=lambda w: self._order(w, now))
            if best.future.done():
                self._remove(best)
                continue
            index = self._take()
            if index is None:
                return
            self._remove(best)
            self.in_flight += 1
            best.future.set_result(index)
        self.report()

    def _remove(self, waiter: _Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)

    def try_acquire(self) -> Slot | None:
        """A slot when one is free and nobody waits; else None."""
        if self._waiters:
            return None
        index = self._take()
        if index is None:
            return None
        self.in_flight += 1
        self.report()
        return Slot(self, index, 0.0)

    async def acquire(self, priority: int = 0) -> Slot:
        """A slot, at once or after waiting; raises `RateLimited` when the queue is full or the wait
        times out. A cancelled waiter (the client left) gives its place up."""
        slot = self.try_acquire()
        if slot is not None:
            return slot
        if len(self._waiters) >= self.queue_size:
            self._refused("queue_full")
            raise RateLimited(
                "the gateway is at its concurrency limit and its queue is full; retry shortly",
                retry_after=1.0,
                code="queue_full",
            )
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        waiter = _Waiter(next(self._seq), priority, started, loop.create_future())
        self._waiters.append(waiter)
        self.report()
        self._queued.set()
        try:
            index = await asyncio.wait_for(asyncio.shield(waiter.future), self.queue_timeout)
        except BaseException as exc:
            self._remove(waiter)
            if waiter.future.done() and not waiter.future.cancelled():
                # Admitted just as the wait ended: hand the slot on.
                Slot(self, waiter.future.result(), 0.0).release()
            else:
                waiter.future.cancel()
            self.report()
            if isinstance(exc, TimeoutError):
                self._refused("queue_timeout")
                raise RateLimited(
                    f"the request waited {self.queue_timeout:g}s for the gateway's concurrency limit; "
                    "retry shortly",
                    retry_after=1.0,
                    code="queue_timeout",
                ) from None
            raise
        waited = time.monotonic() - started
        if self.metrics is not None:
            self.metrics.admission_wait.observe(waited)
        return Slot(self, index, waited)

    async def poll_shared(self) -> None:
        """Admit waiters when another process frees a shared slot. Its release is not announced here,
        so while anyone waits, look again every `SHARED_POLL_SECONDS`; never returns (the app
        lifespan runs it, through `TrafficControl.run`, when slots are shared)."""
        while True:
            await self._queued.wait()
            while self._waiters:
                await asyncio.sleep(SHARED_POLL_SECONDS)
                self._dispatch()
            self._queued.clear()

    def _refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.admission_refused.labels(reason=reason).inc()

    def report(self) -> None:
        """Set admission's gauges (`AdmissionGauges`) to the slots in use and the queue's length."""
        gauges = self.metrics.admission_gauges if self.metrics is not None else None
        if gauges is not None:
            gauges.in_flight.set(self.in_flight)
            gauges.queue_depth.set(len(self._waiters))
