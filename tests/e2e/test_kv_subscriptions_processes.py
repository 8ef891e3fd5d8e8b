"""`serve --workers 2`: every gateway process follows the engine's KV events itself, over a stream of its
own, and ends it when it stops."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.kv_publisher import batch, running_publisher, stored
from tests.support.processes import start_gateway_process

pytestmark = pytest.mark.timeout(120)


async def test_every_gateway_process_holds_its_own_subscription(tmp_path: Path) -> None:
    async with running_publisher() as publisher:
        gateway = await start_gateway_process(
            "--workers",
            "2",
            "--worker-url",
            publisher.url,
            "--engine",
            "sglang",
            "--storage",
            f"sqlite:///{tmp_path / 'gateway.db'}",
        )
        try:
            first = await publisher.subscription(1, timeout=30)
            second = await publisher.subscription(2, timeout=30)
            assert (first.start, second.start) == (0, 0)
            for sub in (first, second):
                sub.send(batch(0, [stored(list(range(16)), 0, 4)]))
            assert not first.closed.is_set() and not second.closed.is_set()
        finally:
            await asyncio.to_thread(gateway.stop)
        await asyncio.wait_for(asyncio.gather(first.closed.wait(), second.closed.wait()), 10)
        assert len(publisher.subscriptions) == 2
