"""`TaskSupervisor`: the owner of every task that outlives the code that started it.

A background response, the watcher that cancels it from another replica, a token charge sent off the
response path: each is spawned here, never with a bare `asyncio.create_task`. The supervisor keeps the
task referenced while it runs (the event loop holds only a weak reference), logs an exception nobody
awaits, and its `aclose()`, called by the app lifespan at shutdown, cancels what still runs and waits
for it, so no task outlives the app. Work whose life is one scope (a body raced against a disconnect,
the lifespan's own loops) stays in that scope, awaited or cancelled there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds `aclose()` waits for cancelled tasks to finish their clean-up before it gives up on them.
CLOSE_TIMEOUT = 10.0


class SupervisorClosed(RuntimeError):
    """Raised by `spawn` once `aclose()` has finished: the app is gone and starts nothing new."""


class TaskSupervisor:
    """Spawns tasks and ends them all on `aclose()`. One per app, closed by its lifespan.

    A task's exception is logged here when it ends, unless it was spawned `awaited` (its callers
    await it and handle the exception); whoever awaits a task still gets its exception. A cancelled
    task is not a failure. Tasks spawned while `aclose()` runs (by a closing task's
    clean-up) are cancelled and awaited too; after it, `spawn` raises `SupervisorClosed`."""

    def __init__(self, *, close_timeout: float = CLOSE_TIMEOUT) -> None:
        self._close_timeout = close_timeout
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    @property
    def running(self) -> int:
        """Tasks spawned here that have not ended yet."""
        return len(self._tasks)

    @property
    def closed(self) -> bool:
        """`aclose()` has begun: `spawn` refuses new tasks."""
        return self._closed

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str, awaited: bool = False) -> asyncio.Task[T]:
        """Run `coro` as a task named `name` (the name is in the failure log line). `awaited`: the
        task's result is awaited by the code that uses it, which handles its exception, so a failure
        is not logged here (a shared load that requests wait for)."""
        if self._closed:
            coro.close()  # never started: not reported as a coroutine never awaited
            raise SupervisorClosed(f"cannot start {name!r}: the gateway's tasks were shut down")
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended_awaited if awaited else self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("task %s failed: %s", task.get_name(), exc, exc_info=exc)

    def _ended_awaited(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Retrieved here too: when every waiter left first, nobody else reads it.
            log.debug("task %s failed: %s", task.get_name(), task.exception())

    async def aclose(self) -> None:
        """Cancel every task and wait until each has ended, up to `close_timeout` seconds in all
        (a task still running then is named in a warning and left). Idempotent."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._close_timeout
        while self._tasks:
            tasks = set(self._tasks)
            for task in tasks:
                task.cancel()
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
            if pending:
                names = ", ".join(sorted(task.get_name() for task in pending))
                log.warning("tasks still running %gs after shutdown began: %s", self._close_timeout, names)
                break
        self._closed = True


__all__ = ["CLOSE_TIMEOUT", "SupervisorClosed", "TaskSupervisor"]
