"""The fleet: every known worker, grouped by the model it serves, with each group's routing policies.

Workers are added from the CLI, the worker API or DNS discovery (routing/dns_discovery.py). A worker is
probed (model info, then health) before it takes traffic; a worker that cannot be reached at start-up
stays pending, logged as unreachable, and is probed again after `retry_interval` seconds, then twice as
long after each failure up to `MAX_RETRY_INTERVAL` (`due_for_probe`), so the gateway can start before
its engines without a warning every few seconds. One line says each worker that joins: its URL, the
engine protocol found, and the model it serves.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..engines.base import EngineClient, ModelInfo, redact_url
from ..errors import Conflict, GatewayError, ModelNotFound, NoHealthyWorker, NotFound, UpstreamUnavailable
from .policy import RoutingPolicy
from .workers import Worker, WorkerKind

log = logging.getLogger(__name__)

#: The longest wait, in seconds, between two probes of a worker that has never answered.
MAX_RETRY_INTERVAL = 60.0


class SharedRegistry(Protocol):
    """The worker registry shared with the other `serve --workers N` processes
    (`shared_registry.SharedWorkers`, which builds on the fleet and so is named here only by its shape).
    `run` and `run_health` belong in the lifespan task group; `close` ends them."""

    async def run(self) -> None: ...
    async def run_health(self) -> None: ...
    async def close(self) -> None: ...
    async def sync(self) -> None: ...
    async def publish(self, worker: Worker) -> None: ...
    async def remove(self, worker_id: str) -> Worker: ...


@dataclass(eq=False)
class ModelGroup:
    name: str
    harmony: bool
    info: ModelInfo
    policy: RoutingPolicy
    prefill_policy: RoutingPolicy | None
    decode_policy: RoutingPolicy | None
    workers: list[Worker] = field(default_factory=list)

    @property
    def regular(self) -> list[Worker]:
        return [w for w in self.workers if w.kind is WorkerKind.REGULAR]

    @property
    def prefill(self) -> list[Worker]:
        return [w for w in self.workers if w.kind is WorkerKind.PREFILL]

    @property
    def decode(self) -> list[Worker]:
        return [w for w in self.workers if w.kind is WorkerKind.DECODE]

    @property
    def disaggregated(self) -> bool:
        """PD mode: prefill and decode pools exist and no regular worker serves the model."""
        return bool(self.prefill) and bool(self.decode) and not self.regular

    def has_available_worker(self) -> bool:
        pools = (self.prefill, self.decode) if self.disaggregated else (self.regular,)
        return all(any(w.available() for w in pool) for pool in pools)


class Fleet:
    """Worker registry. `policy_factory(model_name, role)` returns a routing policy for a new group;
    `admit` gives a worker without an engine of its own `default_engine`, and every worker it admits the
    circuit-breaker cooldown `breaker_cooldown`. An unreachable worker is probed again after
    `retry_interval` seconds, doubling up to `MAX_RETRY_INTERVAL`. `served_model_name` renames the
    model the workers serve (every worker must then serve the same one)."""

    def __init__(
        self,
        client_factory: Callable[[str, str], EngineClient],
        policy_factory: Callable[[str, str], Any],
        harmony_models: frozenset[str] = frozenset(),
        connect_timeout: float = 10.0,
        health_timeout: float = 2.0,
        default_engine: str = "auto",
        breaker_cooldown: float = 30.0,
        retry_interval: float = 5.0,
        served_model_name: str | None = None,
    ) -> None:
        self._client_factory = client_factory
        self._policy_factory = policy_factory
        self._harmony_models = harmony_models
        self._connect_timeout = connect_timeout
        self._health_timeout = health_timeout
        #: When the gateway built its fleet: the `created` of every model it serves (`/v1/models`).
        self.started_at = time.time()
        self._default_engine = default_engine
        self._breaker_cooldown = breaker_cooldown
        self._retry_interval = retry_interval
        self._served_model_name = served_model_name
        #: The engines' name of the model `served_model_name` renames: the first worker's.
        self._renamed_model: str | None = None
        self.groups: dict[str, ModelGroup] = {}
        self.workers: dict[str, Worker] = {}
        #: Called once a worker joins its model group (its first successful probe learnt its model and,
        #: under `--engine auto`, its engine), and when it leaves (`remove`).
        self.on_worker_joined: list[Callable[[Worker], None]] = []
        self.on_worker_removed: list[Callable[[Worker], None]] = []
        #: Ids for new workers; None keeps the default `w1, w2, ...`. Processes sharing a worker
        #: registry need ids that are unique across them (routing/shared_registry.py).
        self.new_worker_id: Callable[[], str] | None = None
        #: The registry shared with the other `serve --workers N` processes, when there is one.
        self.shared: SharedRegistry | None = None

    # -- membership ------------------------------------------------------------------------------
    def create_worker(
        self,
        url: str,
        kind: WorkerKind = WorkerKind.REGULAR,
        engine: str = "auto",
        worker_id: str | None = None,
        *,
        discovered_by: str | None = None,
    ) -> Worker:
        for existing in self.workers.values():
            if existing.url == url and existing.kind is kind:
                raise Conflict(f"worker {redact_url(url)} ({kind.value}) is already registered", param="url")
        client = self._client_factory(url, engine)
        worker = Worker(url=url, client=client, kind=kind, engine=client.engine, discovered_by=discovered_by)
        if worker_id is None and self.new_worker_id is not None:
            worker_id = self.new_worker_id()
        if worker_id is not None:
            worker.id = worker_id
        self.workers[worker.id] = worker
        return worker

    async def admit(
        self,
        url: str,
        kind: WorkerKind = WorkerKind.REGULAR,
        engine: str | None = None,
        worker_id: str | None = None,
        *,
        discovered_by: str | None = None,
    ) -> Worker:
        """Register a worker and probe it; it takes traffic only once a probe succeeded. Raises Conflict
        when the URL is registered with that kind already; an unreachable worker is kept, unhealthy.
        `discovered_by` names the `--worker-dns` target that found it (routing/dns_discovery.py)."""
        worker = self.create_worker(
            url, kind, engine or self._default_engine, worker_id, discovered_by=discovered_by
        )
        worker.breaker_cooldown = self._breaker_cooldown
        await self.probe(worker)
        if worker.healthy and kind is WorkerKind.PREFILL:
            await self._learn_bootstrap_port(worker)
        return worker

    async def _learn_bootstrap_port(self, worker: Worker) -> None:
        if not worker.client.capabilities.server_info:
            return
        with contextlib.suppress(Exception):
            args = await worker.client.server_info(timeout=self._connect_timeout)
            port = args.get("disaggregation_bootstrap_port")
            if port:
                worker.bootstrap_port = int(port)

    async def probe(self, worker: Worker) -> bool:
        """Learn the worker's model (once) and check its health; attach it to its model group. A worker
        whose model cannot be learnt is logged as unreachable and its next probe put off (back-off)."""
        try:
            if worker.model_info is None:
                info = await worker.client.model_info(timeout=self._connect_timeout)
                harmony = info.looks_harmony or info.served_model_name in self._harmony_models
                info = self._served_as(worker, info)
                # `--engine auto` clients know their protocol after the first call.
                worker.engine = worker.client.engine
                worker.model_info = info
                self._attach(worker, harmony)
            healthy = await worker.client.health(self._health_timeout)
        except GatewayError as exc:
            if worker.model_info is None:
                self._unreachable(worker, exc.message)
            else:
                log.warning(
                    "worker %s %s failed its health check: %s", worker.id, worker.public_url, exc.message
                )
            healthy = False
        worker.healthy = healthy
        return healthy

    def due_for_probe(self, worker: Worker, now: float | None = None) -> bool:
        """The worker's model is not known yet and its back-off has run out (`now`: `time.monotonic()`)."""
        return (
            worker.model_info is None and (time.monotonic() if now is None else now) >= worker.next_probe_at
        )

    def _unreachable(self, worker: Worker, reason: str) -> None:
        worker.probe_failures += 1
        worker.probe_error = reason
        wait = min(MAX_RETRY_INTERVAL, self._retry_interval * 2 ** (worker.probe_failures - 1))
        worker.next_probe_at = time.monotonic() + wait
        tries = (
            f"still unreachable after {worker.probe_failures} tries"
            if worker.probe_failures > 1
            else "unreachable"
        )
        log.warning(
            "worker %s %s is %s: %s; trying again in %s s",
            worker.id,
            worker.public_url,
            tries,
            reason,
            f"{wait:g}",
        )

    def _served_as(self, worker: Worker, info: ModelInfo) -> ModelInfo:
        """`info` under `served_model_name`, when set. Raises UpstreamUnavailable for a worker that
        serves another model than the first worker renamed: one name cannot stand for two models."""
        if self._served_model_name is None:
            return info
        engine_name = info.served_model_name
        if self._renamed_model is None:
            self._renamed_model = engine_name
        elif engine_name != self._renamed_model:
            raise UpstreamUnavailable(
                f"it serves {engine_name!r}, but --served-model-name {self._served_model_name!r} already "
                f"stands for {self._renamed_model!r}"
            )
        return replace(info, served_model_name=self._served_model_name)

    def _attach(self, worker: Worker, harmony: bool = False) -> None:
        info = worker.model_info
        assert info is not None
        group = self.groups.get(info.served_model_name)
        if group is None:
            harmony = harmony or info.looks_harmony or info.served_model_name in self._harmony_models
            group = ModelGroup(
                name=info.served_model_name,
                harmony=harmony,
                info=info,
                policy=self._policy_factory(info.served_model_name, "regular"),
                prefill_policy=self._policy_factory(info.served_model_name, "prefill"),
                decode_policy=self._policy_factory(info.served_model_name, "decode"),
            )
            self.groups[group.name] = group
        if worker not in group.workers:
            group.workers.append(worker)
            kind = "" if worker.kind is WorkerKind.REGULAR else f" ({worker.kind.value})"
            retried = f", after {worker.probe_failures} failed tries" if worker.probe_failures else ""
            log.info(
                "worker %s%s %s → %s → %s%s%s",
                worker.id,
                kind,
                worker.public_url,
                worker.engine,
                group.name,
                " (Harmony)" if group.harmony else "",
                retried,
            )
            for callback in self.on_worker_joined:
                callback(worker)

    async def remove(self, worker_id: str) -> Worker:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            raise NotFound(f"no worker with id {worker_id!r}", param="worker_id")
        for name, group in list(self.groups.items()):
            if worker in group.workers:
                group.workers.remove(worker)
                for policy in (group.policy, group.prefill_policy, group.decode_policy):
                    if policy is not None:
                        policy.on_worker_removed(worker)
            if not group.workers:
                del self.groups[name]
        for callback in self.on_worker_removed:
            callback(worker)
        await worker.client.close()
        return worker

    # -- lookup ----------------------------------------------------------------------------------
    def group(self, model: str) -> ModelGroup:
        group = self.groups.get(model)
        if group is not None:
            return group
        pending = [w for w in self.workers.values() if w.model_info is None]
        unreachable = sum(1 for w in pending if w.probe_failures)
        if unreachable:
            # The workers' addresses stay in the gateway's log: they are no business of the clients'.
            workers = (
                "a worker is unreachable, so the model it serves is"
                if unreachable == 1
                else f"{unreachable} workers are unreachable, so the models they serve are"
            )
            raise NoHealthyWorker(
                f"model {model!r} is not available: {workers} not known yet; the gateway keeps trying"
            )
        if pending:
            raise NoHealthyWorker(f"model {model!r} is not available yet: workers are still starting")
        raise ModelNotFound(f"The model {model!r} does not exist", param="model")

    def all_workers(self) -> list[Worker]:
        return list(self.workers.values())

    def ready(self) -> bool:
        return any(g.has_available_worker() for g in self.groups.values())

    async def close(self) -> None:
        for worker in self.workers.values():
            await worker.client.close()
