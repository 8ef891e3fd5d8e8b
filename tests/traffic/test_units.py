"""Key file parsing, gateway-wide slots across processes, and aging in the admission queue."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from harmony_gateway.errors import RateLimited
from harmony_gateway.traffic.admission import Admission, SharedSlots
from harmony_gateway.traffic.keys import KeyPolicy, parse_key_line
from harmony_gateway.traffic.rate_limit import LocalBuckets, format_reset


def test_key_lines() -> None:
    assert parse_key_line("  # comment") is None
    assert parse_key_line("sk-a") == ("sk-a", KeyPolicy())
    assert parse_key_line("sk-b rate_limit=5 token-rate-limit=100 priority=-1") == (
        "sk-b",
        KeyPolicy(rate_limit=5, token_rate_limit=100, priority=-1),
    )
    with pytest.raises(ValueError, match="unknown key option"):
        parse_key_line("sk-c burst=3")
    with pytest.raises(ValueError, match="integer"):
        parse_key_line("sk-c priority=high")


def test_shared_slots_cap_the_gateway_across_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "slots")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from harmony_gateway.traffic.admission import SharedSlots; "
            f"s = SharedSlots({path!r}, 2); print(s.take(), flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"0"
        mine = SharedSlots(path, 2)
        assert mine.take() == 1
        assert mine.take() is None  # the other process holds slot 0
        holder.communicate(b"", timeout=10)  # it exits: the kernel frees its slot
        assert mine.take() == 0
        mine.give(0)
        mine.give(1)
        mine.close()
    finally:
        holder.kill()


async def test_waiting_long_outranks_priority() -> None:
    admission = Admission(1, 3, 30.0, aging=5.0)
    running = admission.try_acquire()
    assert running is not None
    low = asyncio.ensure_future(admission.acquire(0))
    await asyncio.sleep(0)
    high = asyncio.ensure_future(admission.acquire(1))
    await asyncio.sleep(0)
    admission._waiters[0].enqueued = time.monotonic() - 10  # the low waiter waited two levels' worth
    running.release()
    assert (await low).waited >= 0 and not high.done()
    high.cancel()
    with pytest.raises(asyncio.CancelledError):
        await high
    assert admission.queued == 0


async def test_full_queue_is_refused() -> None:
    admission = Admission(1, 0, 30.0)
    assert admission.try_acquire() is not None
    with pytest.raises(RateLimited) as refused:
        await admission.acquire()
    assert refused.value.code == "queue_full" and refused.value.retry_after >= 1


async def test_local_bucket_and_reset_format() -> None:
    buckets = LocalBuckets()
    first = await buckets.run("k", 2, "take", 1)
    assert first.allowed and first.remaining == 1
    assert (await buckets.run("k", 2, "take", 1)).remaining == 0
    refused = await buckets.run("k", 2, "take", 1)
    assert not refused.allowed and refused.retry_after() >= 1
    assert format_reset(0.02) == "20ms" and format_reset(6) == "6s" and format_reset(90) == "1m30s"
