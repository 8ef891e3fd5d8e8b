"""A running gateway (the real CLI, a subprocess) reads its `--api-key-file` again when the file changes
and on SIGHUP: a revoked key gets 401, a new one 200, without a restart."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from harmony_gateway.sim import SimConfig
from tests.e2e._fleet import sims
from tests.support.processes import GatewayProcess, start_gateway_process

pytestmark = pytest.mark.timeout(90)

#: How long a reload may take to be in force: the watcher looks once a second (traffic/keys.py).
RELOAD_BOUND = 10.0


@asynccontextmanager
async def gateway_with_keys(key_file: Path) -> AsyncIterator[tuple[GatewayProcess, httpx.AsyncClient]]:
    async with sims(SimConfig()) as (engine,):
        gateway = await start_gateway_process(
            "--worker-url", engine.url, "--storage", "memory://", "--api-key-file", str(key_file)
        )
        try:
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10) as http:
                yield gateway, http
        finally:
            gateway.stop()


async def status(http: httpx.AsyncClient, key: str) -> int:
    return (await http.get("/models", headers={"authorization": f"Bearer {key}"})).status_code


async def until_statuses(http: httpx.AsyncClient, expected: dict[str, int]) -> None:
    """Wait until every key gets its expected status (a reload is asynchronous to the file's change)."""
    with anyio.fail_after(RELOAD_BOUND):
        while {key: await status(http, key) for key in expected} != expected:
            await anyio.sleep(0.1)


async def test_a_changed_key_file_is_in_force_without_a_restart(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-old-1\nsk-old-2 rate_limit=100\n")
    async with gateway_with_keys(keys) as (gateway, http):
        assert await status(http, "sk-old-1") == 200
        assert await status(http, "sk-new") == 401
        # An editor's atomic save: a new file renamed over the old one (a Secret's update alike).
        (tmp_path / "keys.new").write_text("sk-new\nsk-old-2 rate_limit=100\n")
        os.replace(tmp_path / "keys.new", keys)
        await until_statuses(http, {"sk-old-1": 401, "sk-new": 200, "sk-old-2": 200})
        # Written in place (no rename) it is seen too.
        keys.write_text("sk-fixed\n")
        await until_statuses(http, {"sk-new": 401, "sk-fixed": 200})
        assert gateway.proc.poll() is None


async def test_sighup_reads_the_key_file_again(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-aaaa\n")
    async with gateway_with_keys(keys) as (gateway, http):
        assert await status(http, "sk-aaaa") == 200
        # Rewritten in place with the same size and modification time: only SIGHUP can tell.
        stat = keys.stat()
        with keys.open("r+") as f:
            f.write("sk-bbbb\n")
        os.utime(keys, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        gateway.proc.send_signal(signal.SIGHUP)
        await until_statuses(http, {"sk-aaaa": 401, "sk-bbbb": 200})
        assert gateway.proc.poll() is None  # SIGHUP reloads; it does not end the gateway
