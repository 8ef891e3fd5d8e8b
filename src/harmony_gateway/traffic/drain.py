"""Graceful drain on SIGTERM for the uvicorn server (single process and each `--workers` process).

uvicorn alone closes the listener at once and re-raises the signal after shutdown (the process then
dies by SIGTERM). `DrainingServer` instead: on the first SIGTERM, keeps listening while
`TrafficControl.drain` refuses new requests with 503 + `retry-after` (and `/readiness` with 503, so a
load balancer stops sending), waits for in-flight requests, streams and background responses up to
`--drain-timeout`, cuts what is left (streams end with a terminal error event; cancelling them aborts
their engine requests), then shuts down normally and exits 0. A second SIGTERM or a SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.supervisors import multiprocess
from uvicorn.supervisors.multiprocess import Process

log = logging.getLogger(__name__)

#: The TrafficControl of the app this process serves (set by `create_app`; one app per server process).
current_control: Any = None


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config=config)
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        control = current_control
        if sig != signal.SIGTERM or control is None or self._drain_task is not None or self._loop is None:
            super().handle_exit(sig, frame)
            return
        # Not recorded as captured: uvicorn would re-raise it after shutdown and the process would
        # die by the signal instead of exiting 0 after a clean drain.
        self._loop.call_soon_threadsafe(self._start_drain, control)

    def _start_drain(self, control: Any) -> None:
        control.begin_drain()
        self._drain_task = asyncio.ensure_future(self._drain(control))

    async def _drain(self, control: Any) -> None:
        try:
            await control.drain()
        finally:
            self.should_exit = True


class DrainingProcess(Process):
    """A `serve --workers N` process whose server drains on SIGTERM like the single-process one.

    uvicorn's supervisor creates each process's server from its `Process` class; the supervisor
    forwards SIGTERM to every process, which then drains, and exits 0 once all of them have."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = DrainingServer(config=self.config)
        return self._server


def use_draining_processes() -> None:
    """Make uvicorn's multi-process supervisor start `DrainingProcess`es (call in the supervisor)."""
    multiprocess.Process = DrainingProcess  # type: ignore[misc]
