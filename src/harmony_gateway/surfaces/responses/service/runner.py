"""Background responses: tasks of the app's `TaskSupervisor`, cancellable by response id.

A background response outlives its HTTP request. Each task is tracked so shutdown can stop them all
before the MCP pool closes; the supervisor ends whatever is left with the app.
`POST /cancel` may reach any process or replica: it marks the stored response `cancelled` (a
conditional write, so it never overrides an ending that was stored first), and a watcher beside each
task polls the stored status every `CANCEL_POLL_SECONDS` and cancels the task when it reads
`cancelled`; cancellation reaches `dispatch`, which aborts the engine request. On the replica that
runs the task the cancel endpoint also cancels it directly, without waiting for the poll.
While it runs, its live event feed (`events.EventFeed`) is registered here by response id,
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

from ....pipeline.context import LiveEvents
from ....storage.base import Store
from ....tasks import TaskSupervisor
from ....traffic.middleware import current_ticket
from ..framer import ACTIVE_STATUSES, RUNNER_KEY
from ..objects import ended_response

log = logging.getLogger(__name__)

#: How often the watcher of a running background response reads its stored status (one small query).
CANCEL_POLL_SECONDS = 0.25


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
    def __init__(
        self, runner_id: str, tasks: TaskSupervisor, *, poll_interval: float = CANCEL_POLL_SECONDS
    ) -> None:
        self.runner_id = runner_id
        self.poll_interval = poll_interval
        self._supervisor = tasks
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._feeds: dict[str, LiveEvents] = {}

    def start(
        self, response_id: str, work: Coroutine[Any, Any, None], feed: LiveEvents, store: Store
    ) -> None:
        """Run `work` as the response's task; `feed` (its live events) is reachable until the task ends,
        and a watcher cancels the task once the response stored in `store` reads `cancelled` (a cancel
        received by another process or replica); it ends with the task."""
        task = self._supervisor.spawn(work, name=f"background-{response_id}")
        self._tasks[response_id] = task
        self._hold_admission(response_id, task)
        self._feeds[response_id] = feed
        watcher = self._supervisor.spawn(
            watch_for_cancel(store, response_id, task, self.poll_interval),
            name=f"background-watch-{response_id}",
        )
        task.add_done_callback(lambda _t: watcher.cancel())
        task.add_done_callback(lambda _t: self._forget(response_id))

    def _hold_admission(self, response_id: str, task: asyncio.Task[None]) -> None:
        # The request's admission slot and token budget go with the response: the slot is held, and
        # the tokens charged, until the background task ends, not when the HTTP request returns.
        ticket = current_ticket.get()
        if ticket is None:
            return
        ticket.detach()

        def settle(_task: asyncio.Task[None]) -> None:
            self._supervisor.spawn(ticket.settle(), name=f"background-settle-{response_id}")

        task.add_done_callback(settle)

    def _forget(self, response_id: str) -> None:
        self._tasks.pop(response_id, None)
        self._feeds.pop(response_id, None)

    def feed(self, response_id: str) -> LiveEvents | None:
        """The live event feed of a response running on this replica, or None."""
        return self._feeds.get(response_id)

    @property
    def active(self) -> int:
        """Background responses running in this process (the drain waits for them)."""
        return len(self._tasks)

    def running(self, response_id: str) -> bool:
        return response_id in self._tasks

    async def cancel(self, response_id: str) -> bool:
        task = self._tasks.get(response_id)
        if task is None:
            return False
        if not task.cancelling():
            task.cancel()
        await asyncio.wait({task}, timeout=10)
        return True

    async def shutdown(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)


async def watch_for_cancel(store: Store, response_id: str, task: asyncio.Task[None], interval: float) -> None:
    """Cancel `task` once the stored status of `response_id` is `cancelled`; return when the response
    has ended (or is gone). A failed read is logged and retried at the next interval."""
    while not task.done():
        await asyncio.sleep(interval)
        try:
            status = await store.get_response_status(response_id)
        except Exception as exc:
            log.warning("cancel watcher of %s could not read its status: %s", response_id, exc)
            continue
        if status == "cancelled":
            if not task.cancelling():  # cancelled here already: a second cancel could cut its clean-up
                log.info("background response %s was cancelled elsewhere; stopping it", response_id)
                task.cancel()
            return
        if status is None or status not in ACTIVE_STATUSES:
            return


async def fail_interrupted(store: Store, runner_id: str) -> int:
    """Mark responses this replica was running when it stopped as failed, so none stays in progress."""
    stale = await store.list_responses_with_status({"queued", "in_progress"}, background_only=True)
    count = 0
    for record in stale:
        if not orphaned(record.metadata.get(RUNNER_KEY), runner_id):
            continue  # another replica's or a live sibling process's work
        record.status = "failed"
        record.updated_at = time.time()
        record.response = ended_response(
            record.response,
            "failed",
            {"code": "server_error", "message": "the gateway restarted while this response was running"},
        )
        # Conditional: a sibling that ended or cancelled it meanwhile keeps its own ending.
        if await store.update_response_if(record, ACTIVE_STATUSES):
            count += 1
    if count:
        log.warning("marked %d interrupted background responses as failed", count)
    return count
