"""CPU work over many small items, off the event loop in bounded batches.

One thread call over thousands of messages starves the loop: the worker calls into openai-harmony and
quicktok once per message, both release and retake the GIL, and CPython keeps handing the GIL back to
the thread that just released it, so the loop can wait for the whole call (half a second for 4,000
tool calls with new names). A thread call that ends gives the GIL back for good; splitting the work
into calls of `THREAD_BATCH` items bounds how long the loop can wait to one batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import anyio

T = TypeVar("T")
R = TypeVar("R")

#: Items one thread call handles: 64 messages whose headers are new to this process cost
#: openai-harmony about 20 ms, the longest the loop then waits for the GIL.
THREAD_BATCH = 64


def batches(items: Sequence[T]) -> list[Sequence[T]]:
    return [items[start : start + THREAD_BATCH] for start in range(0, len(items), THREAD_BATCH)]


async def map_off_loop(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """`[fn(item) for item in items]`, computed in worker threads a batch at a time."""
    out: list[R] = []
    for batch in batches(items):
        out += await anyio.to_thread.run_sync(_map, fn, batch)
    return out


def _map(fn: Callable[[T], R], batch: Sequence[T]) -> list[R]:
    return [fn(item) for item in batch]
