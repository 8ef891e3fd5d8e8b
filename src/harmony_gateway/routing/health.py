"""Worker health: periodic probes that flip `Worker.healthy`, and the per-worker circuit breaker.

Probes and requests are separate signals. `HealthChecker` probes every worker each interval and marks it
unhealthy after `failure_threshold` consecutive failed probes, healthy again after `success_threshold`
consecutive good ones. The breaker follows real requests: the pipeline calls `record_failure` /
`record_success` with each outcome, and `breaker_failure_threshold` consecutive failures open it for
`breaker_cooldown` seconds, after which `Worker.available()` half-opens it for a trial request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import anyio

from .workers import BreakerState, Worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Probe cadence and thresholds; times in seconds."""

    interval: float = 5.0
    timeout: float = 2.0
    failure_threshold: int = 3
    success_threshold: int = 2
    breaker_failure_threshold: int = 5
    breaker_cooldown: float = 30.0

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.timeout <= 0 or self.breaker_cooldown < 0:
            raise ValueError("interval and timeout must be positive, breaker_cooldown non-negative")
        if min(self.failure_threshold, self.success_threshold, self.breaker_failure_threshold) < 1:
            raise ValueError("thresholds must be at least 1")


class BreakerConfig(Protocol):
    """The breaker settings `record_failure` reads; `HealthConfig` and the app's `Settings` both fit."""

    @property
    def breaker_failure_threshold(self) -> int: ...

    @property
    def breaker_cooldown(self) -> float: ...


def record_success(worker: Worker) -> None:
    """A request on `worker` succeeded: reset its failure count and close a half-open breaker.

    An open breaker stays open: a success from a request started before it opened proves little, and
    the cool-down decides when to try again.
    """
    worker.breaker_failures = 0
    if worker.breaker is BreakerState.HALF_OPEN:
        worker.breaker = BreakerState.CLOSED
        logger.info("worker %s circuit breaker closed", worker.id)


def record_failure(worker: Worker, config: BreakerConfig, *, now: float | None = None) -> None:
    """A request on `worker` failed in a way that blames the worker (not the client).

    The `breaker_failure_threshold`-th consecutive failure opens the breaker and stamps `now` (default
    `time.monotonic()`); a failed trial request while half-open reopens it at once. Also stores
    `config.breaker_cooldown` on the worker, so `Worker.available()` needs no arguments.
    """
    worker.breaker_cooldown = config.breaker_cooldown
    worker.breaker_failures += 1
    if worker.breaker is BreakerState.OPEN:
        return
    if (
        worker.breaker is BreakerState.HALF_OPEN
        or worker.breaker_failures >= config.breaker_failure_threshold
    ):
        worker.breaker = BreakerState.OPEN
        worker.breaker_opened_at = time.monotonic() if now is None else now
        logger.warning(
            "worker %s circuit breaker open after %d consecutive failures",
            worker.id,
            worker.breaker_failures,
        )


def record_probe(worker: Worker, ok: bool, config: HealthConfig) -> None:
    """Apply one probe result to `worker.healthy` using the consecutive-result thresholds."""
    if ok:
        worker.consecutive_failures = 0
        worker.consecutive_successes += 1
        if not worker.healthy and worker.consecutive_successes >= config.success_threshold:
            worker.healthy = True
            logger.info("worker %s healthy after %d good probes", worker.id, worker.consecutive_successes)
    else:
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        if worker.healthy and worker.consecutive_failures >= config.failure_threshold:
            worker.healthy = False
            logger.warning(
                "worker %s unhealthy after %d failed probes", worker.id, worker.consecutive_failures
            )


class HealthChecker:
    """Probes the workers `workers_provider` returns, all at once, every `config.interval` seconds.

    `run()` loops until cancelled (it belongs in the app's lifespan task group) and re-reads the
    provider each round, so added and removed workers are picked up. Each probe is bounded by
    `config.timeout`, so one hung worker never holds a round up longer than that.
    """

    def __init__(
        self, workers_provider: Callable[[], Iterable[Worker]], config: HealthConfig | None = None
    ) -> None:
        self._workers_provider = workers_provider
        self.config = config if config is not None else HealthConfig()

    async def run(self) -> None:
        """Probe every interval until cancelled; the interval runs from the start of each round."""
        while True:
            started = anyio.current_time()
            await self.check_all()
            await anyio.sleep(max(0.0, self.config.interval - (anyio.current_time() - started)))

    async def check_all(self) -> None:
        """One round: probe every current worker concurrently and apply the results."""
        async with anyio.create_task_group() as tg:
            for worker in list(self._workers_provider()):
                tg.start_soon(self.check, worker)

    async def check(self, worker: Worker) -> bool:
        """Probe one worker and apply the result to its health state; returns the probe result."""
        worker.breaker_cooldown = self.config.breaker_cooldown
        ok = await self.probe(worker)
        record_probe(worker, ok, self.config)
        return ok

    async def probe(self, worker: Worker) -> bool:
        """One health probe, bounded by `config.timeout`; changes no state.

        An exception, a False answer or a timeout all count as failure (False). Only cancellation of
        the caller propagates.
        """
        try:
            with anyio.fail_after(self.config.timeout):
                return bool(await worker.client.health(self.config.timeout))
        except TimeoutError:
            logger.debug("worker %s health probe timed out", worker.id)
        except Exception:
            logger.debug("worker %s health probe failed", worker.id, exc_info=True)
        return False

    async def admit(self, worker: Worker) -> bool:
        """Probe a newly added worker once; on success mark it healthy at once and return True.

        A worker starts unhealthy and takes no traffic until this (or `success_threshold` rounds of
        `run()`) succeeds. On failure it stays unhealthy and `run()` keeps probing it.
        """
        worker.breaker_cooldown = self.config.breaker_cooldown
        ok = await self.probe(worker)
        if ok:
            worker.healthy = True
            worker.consecutive_failures = 0
            worker.consecutive_successes = 0
        else:
            record_probe(worker, ok, self.config)
        return ok
