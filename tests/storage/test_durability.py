"""A response is durable once `put_response` returns: SIGKILL right afterwards does not lose it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from harmony_gateway.storage import open_store

from .conftest import Backend

ALICE = "owner-alice"

# Writes a queued response, then its completed replacement, reports, and waits to be killed:
# the store is never closed, so nothing but the commit inside put_response can have saved it.
WRITER = """
import asyncio, sys, time
from harmony_gateway.storage import StoredResponse, open_store

async def main(url, schema, response_id):
    store = open_store(url, schema=schema or None)
    await store.start()
    for status in ("queued", "completed"):
        await store.put_response(StoredResponse(
            id=response_id, owner="owner-alice", created_at=int(time.time()), updated_at=time.time(),
            status=status, model="gpt-oss-20b", response={"id": response_id, "status": status},
            input_items=[{"id": "msg_1", "type": "message"}], background=True,
        ))
    await store.append_events(response_id, [{"type": "response.completed", "sequence_number": 7}])
    print("written", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:]))
"""


async def test_response_survives_sigkill_after_put(sql_backend: Backend) -> None:
    response_id = f"resp_{os.urandom(8).hex()}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WRITER,
        sql_backend.url,
        sql_backend.schema or "",
        response_id,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=20)  # type: ignore[union-attr]
        assert line == b"written\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL

    store = open_store(sql_backend.url, schema=sql_backend.schema)
    await store.start()
    try:
        stored = await store.get_response(response_id, ALICE)
        assert stored is not None
        assert stored.status == "completed" and stored.response["status"] == "completed"
        assert stored.background is True
        assert await store.list_events(response_id) == [{"type": "response.completed", "sequence_number": 7}]
    finally:
        await store.close()
