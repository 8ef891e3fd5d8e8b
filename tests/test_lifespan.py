"""The app lifespan: a failure during start-up stops what was already started, and shutdown ends every
task the app started."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from harmony_gateway.app import create_app
from harmony_gateway.storage import registry
from harmony_gateway.storage.memory import MemoryStore
from tests.conftest import MODEL
from tests.support.processes import free_port
from tests.support.servers import test_settings, wait_until


class _UnreadableStore(MemoryStore):
    """Starts, then fails the first query (a database that went away during start-up)."""

    opened: list[_UnreadableStore] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.closed = False
        self.opened.append(self)

    async def list_responses_with_status(self, *args: Any, **kwargs: Any) -> Any:
        raise OSError("database unreachable")

    async def close(self) -> None:
        self.closed = True


async def test_a_start_up_failure_closes_the_started_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.STORES, "unreadable", _UnreadableStore)
    monkeypatch.setattr(_UnreadableStore, "opened", [])
    app = create_app(test_settings(storage_url="unreadable://"))
    with pytest.raises(OSError, match="database unreachable"):
        async with app.router.lifespan_context(app):
            pass
    [store] = _UnreadableStore.opened
    assert store.closed


@contextlib.asynccontextmanager
async def slow_sim_process() -> AsyncIterator[str]:
    """A simulated engine in a process of its own (its tasks are not this loop's) that holds every
    generation for a minute before its first token."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "harmony_gateway.cli",
        "sim-engine",
        "--port",
        str(port),
        "--ttft-ms",
        "60000",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def listening() -> bool:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
            return True
        return False

    try:
        deadline = asyncio.get_running_loop().time() + 30
        while not await listening():
            assert proc.poll() is None and asyncio.get_running_loop().time() < deadline, "sim did not start"
            await asyncio.sleep(0.05)
        yield f"grpc://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


# A loop of its own: the session loop also runs other tests' in-process servers, whose tasks come and go.
@pytest.mark.asyncio(loop_scope="function")
async def test_shutdown_leaves_no_task_the_app_started() -> None:
    async with slow_sim_process() as sim_url:
        before = asyncio.all_tasks()
        settings = test_settings(
            worker_urls=(sim_url,), max_concurrent_requests=4, token_rate_limit=1_000_000
        )
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            gateway = app.state.gateway
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
                queued = await http.post(
                    "/v1/responses", json={"model": MODEL, "input": "Hi", "background": True}
                )
                assert queued.status_code == 200 and queued.json()["status"] == "queued"
                # Its task, its cancel watcher, its admission slot: all held while it waits for the engine.
                await wait_until(lambda: gateway.background.active == 1 and gateway.tasks.running >= 2)
        left = {task for task in asyncio.all_tasks() - before if not task.done()}
        assert left == set()
        assert gateway.tasks.running == 0
