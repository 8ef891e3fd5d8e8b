"""Which interrupted background responses a starting gateway process may mark failed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from harmony_gateway.storage import MemoryStore, StoredResponse
from harmony_gateway.surfaces.responses.framer import RUNNER_KEY
from harmony_gateway.surfaces.responses.service.runner import default_runner_id, fail_interrupted, orphaned


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_orphaned_rules() -> None:
    me = default_runner_id(8000)
    host = me.split(":")[0]
    assert me.endswith(f":{os.getpid()}")
    assert orphaned(None, me)  # written before runner ids existed
    assert orphaned(me, me)
    assert orphaned(f"{host}:8000:{_dead_pid()}", me)  # this port, process gone
    assert not orphaned(f"{host}:8000:{os.getppid()}", me)  # a live sibling process
    assert not orphaned(f"{host}:9000:{_dead_pid()}", me)  # another gateway on this host
    assert not orphaned(f"elsewhere:8000:{_dead_pid()}", me)  # another replica


async def test_fail_interrupted_marks_only_orphans() -> None:
    store = MemoryStore()
    await store.start()
    me = default_runner_id(8000)
    host = me.split(":")[0]
    runners = {
        "resp_dead": f"{host}:8000:{_dead_pid()}",
        "resp_sibling": f"{host}:8000:{os.getppid()}",
        "resp_remote": "elsewhere:8000:1",
    }
    for rid, runner in runners.items():
        await store.put_response(
            StoredResponse(
                id=rid,
                owner="",
                created_at=int(time.time()),
                updated_at=time.time(),
                status="in_progress",
                model="m",
                response={"id": rid, "status": "in_progress"},
                background=True,
                metadata={RUNNER_KEY: runner},
            )
        )
    assert await fail_interrupted(store, me) == 1
    statuses = {rid: (await store.get_response(rid, "")).status for rid in runners}
    assert statuses == {"resp_dead": "failed", "resp_sibling": "in_progress", "resp_remote": "in_progress"}
