"""One worker set and one health view for the processes of `serve --workers N`.

Each process keeps its own `Fleet` (engine connections, routing policies, in-flight counts and the
circuit breaker stay per process), and the storage the processes already share holds what they must
agree on:

- Workers registered through the worker API are rows in the store. Every process reconciles its fleet
  with them every `interval` seconds (about 1 s) and right after its own writes: new rows are admitted
  (probed for their model, then routed to), deleted rows are removed. A `POST /workers` answered by one
  process is therefore routed to by all within about a second, and a `DELETE` stops traffic everywhere
  as fast. Workers given on the command line are the same in every process and never change.
- Health is probed by one process at a time: the one holding the `health` lease (a row with an owner,
  `host:port:pid`, and an expiry, renewed at each reconcile and taken over once it expires). It writes
  each worker's health after every round; the others read it at each reconcile instead of probing.

A single process (the default) uses none of this: the fleet and the health checker work in process.
Workers found through DNS (`--worker-dns`, routing/dns_discovery.py) are not rows either: each process
resolves the names itself and gives each worker the id its kind and URL make, the same in every process;
their health is shared like every other worker's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import anyio

from ..errors import Conflict, GatewayError, NotFound
from ..storage.base import Store, StoredWorker, WorkerHealth, worker_health_key
from .fleet import Fleet
from .health import HealthChecker
from .workers import Worker, WorkerKind

log = logging.getLogger(__name__)

HEALTH_LEASE = "health"

#: How often each process reconciles with the store (and the lease holder renews its lease).
DEFAULT_SYNC_INTERVAL = 1.0

#: A lease not renewed for this many reconcile intervals is taken over: a stalled or killed holder
#: stops blocking health checks after a few seconds, while one slow renewal does not hand it over.
LEASE_INTERVALS = 5

#: Admits a worker to this process's fleet under the given id: creates it and probes it (`Fleet.admit`).
Admit = Callable[[str, WorkerKind, str, str], Awaitable[Worker]]


def new_worker_id() -> str:
    return f"w-{uuid.uuid4().hex[:12]}"


def _key(worker: Worker) -> str:
    return worker_health_key(worker.kind.value, worker.url)


class SharedWorkers:
    """The shared registry of one process; `run()` and `run_health()` belong in the lifespan task group.

    Create it after the command-line workers were added: those stay static here (never removed by a
    reconcile, and not deletable through the API, since the other processes would keep them).
    """

    def __init__(
        self,
        fleet: Fleet,
        store: Store,
        checker: HealthChecker,
        admit: Admit,
        owner: str,
        *,
        interval: float = DEFAULT_SYNC_INTERVAL,
        lease_ttl: float | None = None,
        after_sync: Callable[[], None] | None = None,
    ) -> None:
        self.fleet = fleet
        self.store = store
        self.checker = checker
        self.owner = owner
        self.interval = interval
        #: How long the health lease holds without a renewal (default: `LEASE_INTERVALS` reconciles).
        self.lease_ttl = interval * LEASE_INTERVALS if lease_ttl is None else lease_ttl
        self.holds_health_lease = False
        self._admit = admit
        self._after_sync = after_sync
        self._static = set(fleet.workers)
        #: Ids of store rows this process has in its fleet (or tried to admit and cannot).
        self._known: set[str] = set()
        #: Rows this process cannot admit (a command-line worker has the URL): not retried.
        self._refused: set[str] = set()
        self._lock = anyio.Lock()
        fleet.new_worker_id = new_worker_id
        fleet.shared = self

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the registered workers and try the lease once, before the process serves requests."""
        await self._tick()

    async def run(self) -> None:
        """Reconcile every `interval` until cancelled; storage trouble is logged, never fatal."""
        while True:
            await anyio.sleep(self.interval)
            await self._tick()

    async def run_health(self) -> None:
        """Probe every health interval while this process holds the lease, and share the results."""
        interval = self.checker.config.interval
        while True:
            started = anyio.current_time()
            if self.holds_health_lease:
                await self.checker.check_all()
                try:
                    await self.store.put_worker_health(
                        [self._health_row(w) for w in self.fleet.all_workers()]
                    )
                except Exception as exc:
                    log.warning("writing worker health failed: %s", exc)
            await anyio.sleep(max(0.0, interval - (anyio.current_time() - started)))

    async def close(self) -> None:
        """Hand the lease over at once instead of letting the other processes wait for its expiry."""
        if self.holds_health_lease:
            self.holds_health_lease = False
            try:
                await self.store.release_lease(HEALTH_LEASE, self.owner)
            except Exception as exc:
                log.warning("releasing the health lease failed: %s", exc)

    async def _tick(self) -> None:
        try:
            holds = await self.store.acquire_lease(HEALTH_LEASE, self.owner, self.lease_ttl, time.time())
            if holds != self.holds_health_lease:
                log.info("%s the worker health lease", "took" if holds else "lost")
            self.holds_health_lease = holds
            await self.sync()
        except Exception as exc:
            log.warning("reconciling workers with storage failed: %s", exc)

    # -- reconcile -------------------------------------------------------------------------------
    async def sync(self) -> None:
        """Make the fleet match the store: admit new rows, remove deleted ones, apply shared health."""
        async with self._lock:
            rows = await self.store.list_workers()
            wanted = {row.id: row for row in rows}
            for worker_id in sorted(self._known - wanted.keys()):
                self._known.discard(worker_id)
                self._refused.discard(worker_id)
                if worker_id in self.fleet.workers:
                    await self.fleet.remove(worker_id)
                    log.info("worker %s was deleted through another process", worker_id)
            new = [row for row in rows if row.id not in self._known and row.id not in self.fleet.workers]
            self._known.update(wanted)
            if new:
                # Bounded so that an unreachable worker never holds the reconcile up; one whose probe
                # did not finish stays unhealthy and is probed again later.
                with anyio.move_on_after(max(self.interval, self.checker.config.timeout)):
                    async with anyio.create_task_group() as tg:
                        for row in new:
                            tg.start_soon(self._admit_row, row)
                # A row whose admission never got going is tried again at the next reconcile.
                self._known.difference_update(
                    row.id for row in new if row.id not in self.fleet.workers and row.id not in self._refused
                )
            if not self.holds_health_lease:
                await self._apply_health()
        if self._after_sync is not None:
            self._after_sync()

    async def _admit_row(self, row: StoredWorker) -> None:
        try:
            await self._admit(row.url, WorkerKind(row.kind), row.engine, row.id)
        except (GatewayError, ValueError) as exc:
            # A command-line worker with the same URL, or a row this version cannot read.
            self._refused.add(row.id)
            log.warning("cannot add registered worker %s (%s): %s", row.id, row.url, exc)

    async def _apply_health(self) -> None:
        shared = {row.key: row for row in await self.store.list_worker_health()}
        for worker in self.fleet.all_workers():
            row = shared.get(_key(worker))
            if row is None:
                continue
            if worker.model_info is None and row.healthy:
                # Still unknown here: keep it out of routing until this process learnt its model.
                continue
            if worker.healthy != row.healthy:
                log.info("worker %s %s (shared health)", worker.id, "healthy" if row.healthy else "unhealthy")
            worker.healthy = row.healthy
            worker.consecutive_failures = row.consecutive_failures
            worker.consecutive_successes = row.consecutive_successes

    def _health_row(self, worker: Worker) -> WorkerHealth:
        info = dataclasses.asdict(worker.model_info) if worker.model_info is not None else None
        return WorkerHealth(
            key=_key(worker),
            healthy=worker.healthy,
            consecutive_failures=worker.consecutive_failures,
            consecutive_successes=worker.consecutive_successes,
            model_info=info,
            updated_at=time.time(),
        )

    # -- writes from the worker API --------------------------------------------------------------
    async def publish(self, worker: Worker) -> None:
        """Share a worker this process just admitted; on a lost race for its URL, undo and raise Conflict."""
        row = StoredWorker(
            id=worker.id, url=worker.url, kind=worker.kind.value, engine=worker.engine, created_at=time.time()
        )
        async with self._lock:
            try:
                await self.store.add_worker(row)
            except BaseException:
                # Another process registered the URL first (Conflict), or storage failed: a worker
                # only this process routes to is what the shared registry exists to prevent.
                await self.fleet.remove(worker.id)
                raise
            self._known.add(worker.id)
            # Its first probe is the freshest word on its health: the others use it until the lease
            # holder's next round.
            await self.store.put_worker_health([self._health_row(worker)])
        await self.sync()

    async def remove(self, worker_id: str) -> Worker:
        """Delete a registered worker everywhere; NotFound when unknown, Conflict for a static one."""
        await self.sync()
        if worker_id in self._static:
            raise Conflict(
                f"worker {worker_id} was configured on the command line, which every gateway process "
                "reads at start-up; change --worker-url/--prefill/--decode and restart to remove it",
                code="worker_static",
            )
        worker = self.fleet.workers.get(worker_id)
        if worker is None or await self.store.delete_worker(worker_id) is None:
            raise NotFound(f"no worker with id {worker_id!r}", param="worker_id")
        await self.sync()
        return worker


async def publish_worker(fleet: Fleet, worker: Worker) -> None:
    """After `POST /workers` admitted `worker`: share it with the other processes (no-op in one process)."""
    if fleet.shared is not None:
        await fleet.shared.publish(worker)


async def remove_worker(fleet: Fleet, worker_id: str) -> Worker:
    """`DELETE /workers/{id}`: remove the worker from this process, and from every other one when shared.
    Conflict for a worker found through DNS: the next lookup would add it again."""
    worker = fleet.workers.get(worker_id)
    if worker is not None and worker.discovered_by is not None:
        raise Conflict(
            f"worker {worker_id} was found in DNS by --worker-dns {worker.discovered_by}; it leaves the "
            "fleet (drained) once its address is no longer in DNS",
            code="worker_discovered",
        )
    if fleet.shared is not None:
        return await fleet.shared.remove(worker_id)
    return await fleet.remove(worker_id)


async def sync_workers(fleet: Fleet) -> None:
    """Before `GET /workers`: catch up with the other processes' changes (no-op in one process)."""
    if fleet.shared is not None:
        await fleet.shared.sync()
