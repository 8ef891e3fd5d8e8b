"""Measures what a request costs the event loop: `/health` is polled back to back while the request
runs, keeping each poll's latency and every interval between two answers (from the request's start to its
end). The tests run the gateway in their own event loop, so a loop blocked between two polls shows in an
interval, not in a latency."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import httpx


@dataclass
class Stall:
    response: httpx.Response
    #: Seconds each `/health` poll took, sorted.
    latencies: list[float]
    #: Seconds between consecutive `/health` answers (the first from the request's start, the last to its
    #: end): one poll plus whatever held the loop meanwhile.
    intervals: list[float]
    took: float

    def percentile(self, p: float) -> float:
        return self.latencies[min(len(self.latencies) - 1, int(len(self.latencies) * p))]

    @property
    def p99(self) -> float:
        return self.percentile(0.99)

    @property
    def longest_stall(self) -> float:
        return max(self.intervals)


async def _poll_health(
    http: httpx.AsyncClient, done: asyncio.Event, pause: float
) -> tuple[list[float], list[float]]:
    answered, latencies = [time.perf_counter()], []
    while not done.is_set():
        start = time.perf_counter()
        response = await http.get("/health")
        answered.append(time.perf_counter())
        latencies.append(answered[-1] - start)
        assert response.status_code == 200
        if pause:
            await asyncio.sleep(pause)
    return answered, latencies


async def health_while(
    http: httpx.AsyncClient, request: Awaitable[httpx.Response], *, pause: float = 0.0, pollers: int = 1
) -> Stall:
    """Run `request` while `pollers` clients poll `/health` back to back (`pause` seconds apart) on
    `http`. (Several pollers add samples but not information: one held GIL delays them all alike.)"""
    done = asyncio.Event()
    polling = [asyncio.create_task(_poll_health(http, done, pause)) for _ in range(pollers)]
    try:
        start = time.perf_counter()
        response = await request
        end = time.perf_counter()
    finally:
        done.set()
    latencies: list[float] = []
    intervals: list[float] = []
    for answered, polled in await asyncio.gather(*polling):
        answered.append(end)
        intervals += [b - a for a, b in zip(answered, answered[1:], strict=False)]
        latencies += polled
    return Stall(response, sorted(latencies), intervals, end - start)
