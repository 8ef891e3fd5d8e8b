"""`SharedWorkers` with two fleets on one SQLite store: two gateway processes, in one test process."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from harmony_gateway.engines.registry import create_client
from harmony_gateway.errors import Conflict, NotFound
from harmony_gateway.routing.fleet import Fleet
from harmony_gateway.routing.health import HealthChecker, HealthConfig
from harmony_gateway.routing.registry import create_policy
from harmony_gateway.routing.shared_registry import (
    HEALTH_LEASE,
    SharedWorkers,
    publish_worker,
    remove_worker,
    sync_workers,
)
from harmony_gateway.routing.workers import Worker, WorkerKind
from harmony_gateway.sim import SimConfig
from harmony_gateway.storage import Store, open_store
from tests.conftest import MODEL
from tests.e2e._fleet import sims

HEALTH = HealthConfig(interval=0.1, timeout=0.5, failure_threshold=1, success_threshold=1)


async def admit(
    fleet: Fleet, url: str, kind: WorkerKind, engine: str, worker_id: str | None = None
) -> Worker:
    worker = fleet.create_worker(url, kind, engine, worker_id)
    await fleet.probe(worker)
    return worker


@contextlib.asynccontextmanager
async def process(store: Store, name: str, static_url: str) -> AsyncIterator[SharedWorkers]:
    fleet = Fleet(
        client_factory=lambda url, engine: create_client(url, engine),
        policy_factory=lambda model, role: create_policy("round_robin"),
    )
    await admit(fleet, static_url, WorkerKind.REGULAR, "auto")
    shared = SharedWorkers(
        fleet,
        store,
        HealthChecker(fleet.all_workers, HEALTH),
        lambda url, kind, engine, worker_id: admit(fleet, url, kind, engine, worker_id),
        name,
        interval=0.1,
        # Fast reconciles, but a lease that moves only when released: a loaded machine that stalls the
        # holder's renewals for half a second must not hand it over behind the test's back.
        lease_ttl=60.0,
    )
    try:
        await shared.start()
        yield shared
    finally:
        await shared.close()
        await fleet.close()


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    store = open_store(f"sqlite:///{tmp_path / 'gw.db'}")
    await store.start()
    try:
        yield store
    finally:
        await store.close()


async def test_a_worker_published_by_one_process_is_admitted_and_removed_by_the_other(store: Store) -> None:
    async with (
        sims(SimConfig(), SimConfig(model="other-model")) as (static, extra),
        process(store, "host:1:1", static.url) as one,
        process(store, "host:1:2", static.url) as two,
    ):
        worker = await admit(one.fleet, extra.url, WorkerKind.REGULAR, "auto")
        await publish_worker(one.fleet, worker)
        assert worker.id.startswith("w-")
        await sync_workers(two.fleet)
        mirrored = two.fleet.workers[worker.id]
        assert (mirrored.url, mirrored.model_id, mirrored.healthy) == (extra.url, "other-model", True)
        assert two.fleet.group("other-model").workers == [mirrored]

        # The same URL again, through the other process: the store refuses it and nothing is left behind.
        duplicate = two.fleet.workers.pop(worker.id)
        again = await admit(two.fleet, extra.url, WorkerKind.REGULAR, "auto")
        with pytest.raises(Conflict):
            await publish_worker(two.fleet, again)
        assert again.id not in two.fleet.workers
        two.fleet.workers[duplicate.id] = duplicate

        static_id = next(w.id for w in two.fleet.all_workers() if w.url == static.url)
        with pytest.raises(Conflict):
            await remove_worker(two.fleet, static_id)
        assert (await remove_worker(two.fleet, worker.id)).id == worker.id
        with pytest.raises(NotFound):
            await remove_worker(two.fleet, worker.id)
        await sync_workers(one.fleet)
        assert [w.url for w in one.fleet.all_workers()] == [static.url]
        assert "other-model" not in one.fleet.groups and MODEL in one.fleet.groups


async def test_one_process_probes_and_the_other_follows_its_results(store: Store) -> None:
    async with (
        sims(SimConfig(), SimConfig(model="other-model")) as (static, extra),
        process(store, "host:1:1", static.url) as one,
        process(store, "host:1:2", static.url) as two,
        anyio.create_task_group() as follower_tasks,
    ):
        assert [one.holds_health_lease, two.holds_health_lease] == [True, False]
        worker = await admit(two.fleet, extra.url, WorkerKind.REGULAR, "auto")
        await publish_worker(two.fleet, worker)
        follower_tasks.start_soon(two.run)
        follower_tasks.start_soon(two.run_health)
        async with anyio.create_task_group() as holder_tasks:
            holder_tasks.start_soon(one.run)
            holder_tasks.start_soon(one.run_health)
            await sync_workers(one.fleet)
            assert one.fleet.workers[worker.id].healthy and two.fleet.workers[worker.id].healthy

            await extra.stop()
            held, followed = one.fleet.workers[worker.id], two.fleet.workers[worker.id]
            # Only the holder probes; the follower takes the result, counts included, from the store.
            with anyio.fail_after(10):
                while held.healthy or followed.healthy or followed.consecutive_failures < 1:
                    await anyio.sleep(0.02)
            assert two.holds_health_lease is False
            assert not await store.acquire_lease(HEALTH_LEASE, "host:1:3", 5.0, time.time())
            holder_tasks.cancel_scope.cancel()

        # The holder stops (and releases the lease): the follower takes over and probes from now on.
        await one.close()
        with anyio.fail_after(10):
            while not two.holds_health_lease:
                await anyio.sleep(0.02)
        follower_tasks.cancel_scope.cancel()
