from __future__ import annotations

import time

import anyio
import pytest

from harmony_gateway.routing import (
    BreakerState,
    HealthChecker,
    HealthConfig,
    record_failure,
    record_success,
)

from ._fakes import HANG, FakeEngine, make_worker

FAST = HealthConfig(interval=0.02, timeout=0.05, failure_threshold=3, success_threshold=2)


async def test_failure_threshold_marks_unhealthy_and_success_threshold_restores() -> None:
    worker = make_worker("w", script=[False, False, False, True, True, True])
    checker = HealthChecker(lambda: [worker], FAST)
    seen = []
    for _ in range(6):
        await checker.check_all()
        seen.append(worker.healthy)
    assert seen == [True, True, False, False, True, True]


async def test_a_good_probe_resets_the_failure_count() -> None:
    worker = make_worker("w", script=[False, False, True, False, False, True])
    checker = HealthChecker(lambda: [worker], FAST)
    for _ in range(6):
        await checker.check_all()
        assert worker.healthy


async def test_exceptions_and_timeouts_count_as_failures() -> None:
    worker = make_worker("w", script=[ConnectionError("refused"), HANG, RuntimeError("boom")])
    checker = HealthChecker(lambda: [worker], FAST)
    assert await checker.probe(worker) is False
    assert await checker.probe(worker) is False
    assert worker.healthy  # probe() alone changes nothing
    for _ in range(3):
        await checker.check(worker)
    assert not worker.healthy


async def test_hanging_probe_does_not_delay_the_others() -> None:
    hung = make_worker("hung", script=[HANG])
    fine = [make_worker(f"ok{i}", healthy=False, script=[True]) for i in range(5)]
    config = HealthConfig(timeout=0.1, failure_threshold=1, success_threshold=1)
    checker = HealthChecker(lambda: [hung, *fine], config)
    started = time.monotonic()
    await checker.check_all()
    elapsed = time.monotonic() - started
    assert elapsed < 0.5
    assert all(w.healthy for w in fine)
    assert not hung.healthy
    assert isinstance(hung.client, FakeEngine) and hung.client.cancelled == 1


async def test_admit_requires_a_good_probe_before_traffic() -> None:
    checker = HealthChecker(lambda: [], FAST)
    down = make_worker("down", healthy=False, script=[False])
    up = make_worker("up", healthy=False, script=[True])
    assert await checker.admit(down) is False
    assert not down.available()
    assert await checker.admit(up) is True
    assert up.available()


async def test_run_probes_every_interval_picks_up_new_workers_and_cancels_cleanly() -> None:
    workers = [make_worker("a", healthy=False)]
    checker = HealthChecker(lambda: workers, HealthConfig(interval=0.02, timeout=0.05, success_threshold=2))
    async with anyio.create_task_group() as tg:
        tg.start_soon(checker.run)
        await anyio.sleep(0.07)
        workers.append(make_worker("b", healthy=False))
        await anyio.sleep(0.1)
        tg.cancel_scope.cancel()
    a, b = workers
    assert a.healthy and b.healthy
    assert isinstance(a.client, FakeEngine) and a.client.calls >= 4


async def test_run_cancels_a_hanging_probe_promptly() -> None:
    hung = make_worker("hung", script=[HANG])
    checker = HealthChecker(lambda: [hung], HealthConfig(interval=5.0, timeout=5.0))
    started = time.monotonic()
    with anyio.move_on_after(0.05):
        await checker.run()
    assert time.monotonic() - started < 0.5
    assert isinstance(hung.client, FakeEngine) and hung.client.cancelled == 1


def test_breaker_opens_after_threshold_half_opens_after_cooldown_and_closes_on_success() -> None:
    config = HealthConfig(breaker_failure_threshold=3, breaker_cooldown=10.0)
    worker = make_worker("w")
    for t in (100.0, 101.0):
        record_failure(worker, config, now=t)
    assert worker.breaker is BreakerState.CLOSED
    record_failure(worker, config, now=102.0)
    assert worker.breaker is BreakerState.OPEN
    assert worker.breaker_opened_at == 102.0
    assert not worker.available(now=111.9)
    assert worker.available(now=112.0)  # the cooldown comes from config, stored on the worker
    assert worker.breaker is BreakerState.HALF_OPEN
    record_success(worker)
    assert worker.breaker is BreakerState.CLOSED
    assert worker.breaker_failures == 0


def test_failed_trial_reopens_at_once() -> None:
    config = HealthConfig(breaker_failure_threshold=2, breaker_cooldown=5.0)
    worker = make_worker("w")
    record_failure(worker, config, now=0.0)
    record_failure(worker, config, now=1.0)
    assert worker.available(now=6.0)
    record_failure(worker, config, now=6.5)
    assert worker.breaker is BreakerState.OPEN
    assert not worker.available(now=11.0)
    assert worker.available(now=11.5)


def test_success_resets_the_consecutive_count() -> None:
    config = HealthConfig(breaker_failure_threshold=2)
    worker = make_worker("w")
    record_failure(worker, config, now=0.0)
    record_success(worker)
    record_failure(worker, config, now=1.0)
    assert worker.breaker is BreakerState.CLOSED


def test_late_success_does_not_close_an_open_breaker() -> None:
    config = HealthConfig(breaker_failure_threshold=1, breaker_cooldown=5.0)
    worker = make_worker("w")
    record_failure(worker, config, now=0.0)
    record_success(worker)
    assert worker.breaker is BreakerState.OPEN
    assert not worker.available(now=1.0)


async def test_checker_stores_the_cooldown_on_workers() -> None:
    worker = make_worker("w")
    await HealthChecker(lambda: [worker], HealthConfig(breaker_cooldown=7.0)).check_all()
    assert worker.breaker_cooldown == 7.0


@pytest.mark.parametrize(
    "bad", [{"interval": 0}, {"timeout": -1}, {"failure_threshold": 0}, {"breaker_cooldown": -1}]
)
def test_config_rejects_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HealthConfig(**bad)  # type: ignore[arg-type]


def test_defaults() -> None:
    config = HealthConfig()
    assert (config.interval, config.timeout) == (5.0, 2.0)
    assert (config.failure_threshold, config.success_threshold) == (3, 2)
    assert (config.breaker_failure_threshold, config.breaker_cooldown) == (5, 30.0)
