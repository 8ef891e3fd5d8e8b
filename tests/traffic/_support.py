"""A fresh simulated engine and gateway per test (admission tests count the engine's peak load)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as redis

from harmony_gateway.sim import SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.servers import RunningGateway, running_gateway, test_settings


@contextlib.asynccontextmanager
async def sim_and_gateway(
    sim_config: SimConfig | None = None, **overrides: Any
) -> AsyncIterator[tuple[Any, RunningGateway]]:
    async with await start_sim_engine(sim_config or SimConfig(port=0)) as sim:
        async with running_gateway(test_settings(worker_urls=(sim.url,), **overrides)) as gw:
            yield sim, gw


def chat_body(text: str = "Hello there", stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": stream}


async def stream_chat(
    http: httpx.AsyncClient, text: str = "Hello there", headers: dict[str, str] | None = None
) -> tuple[int, httpx.Headers, bytes]:
    async with http.stream("POST", "/v1/chat/completions", json=chat_body(text), headers=headers) as r:
        return r.status_code, r.headers, await r.aread()


async def until(predicate: Any, timeout: float = 15.0) -> None:
    """Wait for a state the test drives towards (polling a condition, not a sleep for ordering)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


#: A Redis database of these tests' own; every key they write is removed afterwards.
REDIS_HOST = os.environ.get("GATEWAY_TEST_REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("GATEWAY_TEST_REDIS_PORT", "6379"))
REDIS_DB = 11
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"


@pytest.fixture
async def require_redis() -> None:
    """Redis must answer; without it these tests skip locally and fail in CI (as PostgreSQL's do)."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        await client.ping()
    except (OSError, redis.RedisError) as exc:
        message = f"Redis at {REDIS_URL} is not reachable ({exc})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def redis_keys():  # type: ignore[no-untyped-def]
    client = redis.Redis.from_url(REDIS_URL)
    try:
        yield client
    finally:
        keys = [k async for k in client.scan_iter("harmony-gateway:rl:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
