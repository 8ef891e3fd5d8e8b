"""Measures what a request costs the event loop: `/health` is polled while the request runs, and every
interval between two answers (from the request's start to its end) is kept. The tests run the gateway in
their own event loop, so a blocked loop also stops the polling: an interval, not a latency alone, shows it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import httpx


@dataclass
class Stall:
    response: httpx.Response
    #: Seconds between consecutive `/health` answers (the first from the request's start, the last to its
    #: end), sorted: each is one poll plus whatever held the loop meanwhile.
    latencies: list[float]
    took: float

    @property
    def p99(self) -> float:
        return self.latencies[min(len(self.latencies) - 1, int(len(self.latencies) * 0.99))]


async def _poll_health(http: httpx.AsyncClient, done: asyncio.Event, pause: float) -> list[float]:
    answered = [time.perf_counter()]
    while not done.is_set():
        response = await http.get("/health")
        answered.append(time.perf_counter())
        assert response.status_code == 200
        if pause:
            await asyncio.sleep(pause)
    return answered


async def health_while(
    http: httpx.AsyncClient, request: Awaitable[httpx.Response], *, pause: float = 0.0
) -> Stall:
    """Run `request` while `/health` is polled back to back (`pause` seconds apart) on `http`."""
    done = asyncio.Event()
    poller = asyncio.create_task(_poll_health(http, done, pause))
    try:
        start = time.perf_counter()
        response = await request
        end = time.perf_counter()
    finally:
        done.set()
    answered = [*await poller, end]
    intervals = [b - a for a, b in zip(answered, answered[1:], strict=False)]
    return Stall(response, sorted(intervals), end - start)
