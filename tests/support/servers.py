"""Real servers on loopback for tests: the gateway under uvicorn on 127.0.0.1:0, next to sim engines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import uvicorn

from harmony_gateway.api.admin import admin_server
from harmony_gateway.api.http_protocol import server_options
from harmony_gateway.app import create_app
from harmony_gateway.pipeline.context import ENGINE_ID_SEPARATOR
from harmony_gateway.settings import Settings

TEST_DATE = "2026-01-15"


@dataclass
class RunningGateway:
    url: str
    app: Any
    server: uvicorn.Server
    #: The admin listener's URL when `settings.admin_port` is set (0 picks a free port).
    admin_url: str | None = None

    @property
    def state(self) -> Any:
        return self.app.state.gateway

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


def test_settings(**overrides: Any) -> Settings:
    base = Settings(
        conversation_start_date=TEST_DATE,
        storage_url="memory://",
        health_interval=0.5,
        health_timeout=1.0,
        retry_backoff=0.01,
    )
    return replace(base, **overrides)


test_settings.__test__ = False  # type: ignore[attr-defined]  # a factory, not a test


@contextlib.asynccontextmanager
async def running_gateway(settings: Settings) -> AsyncIterator[RunningGateway]:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        access_log=False,
        lifespan="on",
        log_config=None,
        **server_options(settings),
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    admin: uvicorn.Server | None = None
    admin_task: asyncio.Task[None] | None = None
    try:
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        if task.done():
            task.result()
            raise RuntimeError("gateway did not start")
        port = server.servers[0].sockets[0].getsockname()[1]
        admin_url = None
        if settings.admin_port is not None:
            admin = admin_server(app, settings.admin_host, settings.admin_port, "warning")
            admin_task = asyncio.create_task(admin.serve())
            for _ in range(500):
                if admin.started or admin_task.done():
                    break
                await asyncio.sleep(0.01)
            if admin_task.done():
                admin_task.result()
                raise RuntimeError("admin listener did not start")
            admin_port = admin.servers[0].sockets[0].getsockname()[1]
            admin_url = f"http://{settings.admin_host}:{admin_port}"
        yield RunningGateway(url=f"http://127.0.0.1:{port}", app=app, server=server, admin_url=admin_url)
    finally:
        if admin is not None:
            admin.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(admin_task, 10)
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)


async def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.05) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if predicate():
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


def client_request_id(engine_id: str) -> str:
    """The client-visible request id an engine request id was made from (`pipeline.context`)."""
    return engine_id.rsplit(ENGINE_ID_SEPARATOR, 1)[0]


def client_request_ids(engine_ids: Any) -> set[str]:
    return {client_request_id(engine_id) for engine_id in engine_ids}
