"""Background responses: tasks owned by the app lifespan, cancellable by response id.

A background response outlives its HTTP request. Each task is tracked so `POST /cancel` can stop it
(cancellation reaches `dispatch`, which aborts the engine request) and shutdown can stop them all.
While it runs, its live event feed (`responses_events.EventFeed`) is registered here by response id,
so a stream resumed on this replica follows it; the feed leaves with the task.
Responses a previous run of this replica left queued or in progress are marked failed at start-up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)

RUNNER_KEY = "_runner"


def default_runner_id(port: int) -> str:
    """`host:port:pid`: which gateway process runs a background response. The pid tells processes of
    one `serve --workers N` apart, and lets a restarted process recognise work whose process is gone."""
    return f"{socket.gethostname()}:{port}:{os.getpid()}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def orphaned(runner: str | None, me: str) -> bool:
    """True when the process that ran a response is gone: it ran on this host and port (or the record
    predates runner ids) and its pid is no longer alive. Work of other hosts, other ports and live
    sibling processes is never touched."""
    if runner is None:
        return True
    if runner == me:
        return True
    host, _, rest = runner.partition(":")
    port, _, pid = rest.partition(":")
    my_host, _, my_rest = me.partition(":")
    my_port = my_rest.partition(":")[0]
    if host != my_host or port != my_port:
        return False
    return not (pid.isdigit() and _process_alive(int(pid)))


class BackgroundRunner:
    def __init__(self, runner_id: str) -> None:
        self.runner_id = runner_id
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._feeds: dict[str, Any] = {}

    def start(self, response_id: str, work: Coroutine[Any, Any, None], feed: Any = None) -> None:
        """Run `work` as the response's task; `feed` (its live events) is reachable until the task ends."""
        task = asyncio.create_task(work, name=f"background-{response_id}")
        self._tasks[response_id] = task
        if feed is not None:
            self._feeds[response_id] = feed
        task.add_done_callback(lambda _t: self._forget(response_id))

    def _forget(self, response_id: str) -> None:
        self._tasks.pop(response_id, None)
        self._feeds.pop(response_id, None)

    def feed(self, response_id: str) -> Any:
        """The live event feed of a response running on this replica, or None."""
        return self._feeds.get(response_id)

    def running(self, response_id: str) -> bool:
        return response_id in self._tasks

    async def cancel(self, response_id: str) -> bool:
        task = self._tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=10)
        return True

    async def shutdown(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)


async def fail_interrupted(store: Any, runner_id: str) -> int:
    """Mark responses this replica was running when it stopped as failed, so none stays in progress."""
    stale = await store.list_responses_with_status({"queued", "in_progress"}, background_only=True)
    count = 0
    for record in stale:
        if not orphaned(record.metadata.get(RUNNER_KEY), runner_id):
            continue  # another replica's or a live sibling process's work
        record.status = "failed"
        record.updated_at = time.time()
        record.response = dict(
            record.response,
            status="failed",
            error={
                "code": "server_error",
                "message": "the gateway restarted while this response was running",
            },
        )
        await store.put_response(record)
        count += 1
    if count:
        log.warning("marked %d interrupted background responses as failed", count)
    return count
