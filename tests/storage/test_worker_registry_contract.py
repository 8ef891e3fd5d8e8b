"""The shared worker registry and lease part of the `Store` contract, over memory, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from pathlib import Path

import pytest

from harmony_gateway import errors
from harmony_gateway.storage import (
    SCHEMA_VERSION,
    Store,
    StoredWorker,
    WorkerHealth,
    open_store,
    worker_health_key,
)

from .conftest import Backend


def worker(url: str | None = None, kind: str = "regular", created_at: float | None = None) -> StoredWorker:
    return StoredWorker(
        id=f"w-{uuid.uuid4().hex[:12]}",
        url=url or f"grpc://10.0.0.{uuid.uuid4().int % 250}:{50000 + uuid.uuid4().int % 1000}",
        kind=kind,
        engine="auto",
        created_at=time.time() if created_at is None else created_at,
    )


def health(key: str, healthy: bool = True, failures: int = 0, successes: int = 1) -> WorkerHealth:
    return WorkerHealth(
        key=key,
        healthy=healthy,
        consecutive_failures=failures,
        consecutive_successes=successes,
        model_info={"served_model_name": "gpt-oss-20b", "architectures": ["GptOssForCausalLM"]},
        updated_at=time.time(),
    )


async def test_workers_add_list_delete(store: Store) -> None:
    first = worker("grpc://a:1", created_at=1.0)
    second = worker("grpc://b:1", created_at=2.0)
    await store.add_worker(second)
    await store.add_worker(first)
    assert await store.list_workers() == [first, second]
    assert await store.delete_worker(first.id) == first
    assert await store.list_workers() == [second]
    assert await store.delete_worker(first.id) is None


async def test_same_url_and_kind_registers_once(store: Store) -> None:
    await store.add_worker(worker("grpc://a:1"))
    with pytest.raises(errors.Conflict):
        await store.add_worker(worker("grpc://a:1"))
    # Another kind on the same URL is another worker (PD: prefill and decode pools).
    await store.add_worker(worker("grpc://a:1", kind="prefill"))
    assert {w.kind for w in await store.list_workers()} == {"regular", "prefill"}


async def test_health_rows_upsert_and_go_with_their_worker(store: Store) -> None:
    w = worker("grpc://a:1")
    await store.add_worker(w)
    key = worker_health_key(w.kind, w.url)
    static_key = worker_health_key("regular", "grpc://static:1")
    await store.put_worker_health([health(key), health(static_key)])
    await store.put_worker_health([health(key, healthy=False, failures=3, successes=0)])
    rows = {h.key: h for h in await store.list_worker_health()}
    assert rows[key].healthy is False and rows[key].consecutive_failures == 3
    assert rows[key].model_info == {
        "served_model_name": "gpt-oss-20b",
        "architectures": ["GptOssForCausalLM"],
    }
    assert rows[static_key].healthy is True
    await store.delete_worker(w.id)
    assert [h.key for h in await store.list_worker_health()] == [static_key]


async def test_lease_is_held_renewed_and_taken_over_after_expiry(store: Store) -> None:
    now = 1000.0
    assert await store.acquire_lease("health", "host:1:10", ttl=5.0, now=now)
    assert not await store.acquire_lease("health", "host:1:11", ttl=5.0, now=now + 1)
    assert await store.acquire_lease("health", "host:1:10", ttl=5.0, now=now + 4)  # renewed to now + 9
    assert not await store.acquire_lease("health", "host:1:11", ttl=5.0, now=now + 8)
    assert await store.acquire_lease("health", "host:1:11", ttl=5.0, now=now + 9.5)
    assert not await store.acquire_lease("health", "host:1:10", ttl=5.0, now=now + 10)
    # Leases are independent by name.
    assert await store.acquire_lease("other", "host:1:10", ttl=5.0, now=now + 10)


async def test_released_lease_is_free_at_once(store: Store) -> None:
    assert await store.acquire_lease("health", "a", ttl=60.0, now=0.0)
    await store.release_lease("health", "b")  # not b's: nothing happens
    assert not await store.acquire_lease("health", "b", ttl=60.0, now=1.0)
    await store.release_lease("health", "a")
    assert await store.acquire_lease("health", "b", ttl=60.0, now=1.0)


@pytest.mark.parametrize("contenders", [8])
async def test_one_winner_among_stores_racing_for_a_lease(sql_backend: Backend, contenders: int) -> None:
    stores = [await sql_backend.open() for _ in range(contenders)]
    now = time.time()
    won = await asyncio.gather(
        *(s.acquire_lease("health", f"host:1:{i}", ttl=30.0, now=now) for i, s in enumerate(stores))
    )
    assert sum(won) == 1


async def test_registry_is_shared_between_stores(sql_backend: Backend) -> None:
    one, two = await sql_backend.open(), await sql_backend.open()
    w = worker("grpc://shared:1")
    await one.add_worker(w)
    assert await two.list_workers() == [w]
    with pytest.raises(errors.Conflict):
        await two.add_worker(worker("grpc://shared:1"))
    assert await two.delete_worker(w.id) == w
    assert await one.list_workers() == []


async def test_a_version_1_database_is_migrated(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'v1.db'}"
    store = open_store(url)
    await store.start()
    await store.close()
    # Make it look like a database written before the worker registry existed.
    with sqlite3.connect(tmp_path / "v1.db") as conn:
        for table in ("workers", "worker_health", "leases"):
            conn.execute(f"DROP TABLE {table}")
        conn.execute("DELETE FROM schema_version WHERE version >= 2")
    store = open_store(url)
    await store.start()
    try:
        await store.add_worker(worker("grpc://after-upgrade:1"))
        assert [w.url for w in await store.list_workers()] == ["grpc://after-upgrade:1"]
    finally:
        await store.close()
    with sqlite3.connect(tmp_path / "v1.db") as conn:
        assert conn.execute("SELECT max(version) FROM schema_version").fetchone() == (SCHEMA_VERSION,)
