"""The contract every registered policy meets; a new entry in POLICIES is checked automatically."""

from __future__ import annotations

import dataclasses
import random
from unittest import mock

import pytest

from harmony_gateway.errors import NoHealthyWorker
from harmony_gateway.routing import POLICIES, BreakerState, RoutingRequest, create_policy

from ._fakes import make_worker, make_workers

pytestmark = pytest.mark.parametrize("name", sorted(POLICIES))


def requests(n: int = 200) -> list[RoutingRequest]:
    rng = random.Random(7)
    out = []
    for i in range(n):
        ids = [rng.randrange(200_000) for _ in range(rng.randrange(1, 60))]
        out.append(
            RoutingRequest(
                model="gpt-oss-20b",
                input_ids=ids,
                selection_text=f"question {i % 17}",
                routing_key=None if i % 3 == 0 else f"session-{i % 11}",
                request_id=f"req-{i}",
            )
        )
    return out


def test_never_selects_an_unavailable_worker(name: str) -> None:
    policy = create_policy(name)
    ok_a, ok_b = make_worker("ok-a"), make_worker("ok-b")
    down = make_worker("down", healthy=False)
    tripped = make_worker("tripped")
    tripped.breaker = BreakerState.OPEN
    tripped.breaker_opened_at = 1e18  # opened "now" whatever the clock says
    workers = [down, ok_a, tripped, ok_b]
    chosen = {policy.select(workers, r).id for r in requests()}
    assert chosen <= {"ok-a", "ok-b"}


def test_raises_no_healthy_worker_on_empty_list(name: str) -> None:
    with pytest.raises(NoHealthyWorker):
        create_policy(name).select([], requests(1)[0])


def test_raises_no_healthy_worker_when_none_available(name: str) -> None:
    workers = make_workers(3)
    workers[0].healthy = False
    workers[1].healthy = False
    workers[2].breaker = BreakerState.OPEN
    workers[2].breaker_opened_at = 1e18
    with pytest.raises(NoHealthyWorker) as info:
        create_policy(name).select(workers, requests(1)[0])
    assert info.value.status_code == 503


def test_returns_one_of_the_given_workers(name: str) -> None:
    policy = create_policy(name)
    workers = make_workers(5)
    for r in requests():
        chosen = policy.select(workers, r)
        assert any(chosen is w for w in workers)
        policy.on_request_done(chosen, r)


def test_single_available_worker_always_wins(name: str) -> None:
    policy = create_policy(name)
    workers = make_workers(4)
    for w in workers[1:]:
        w.healthy = False
    assert {policy.select(workers, r).id for r in requests(50)} == {"w0"}


def test_half_open_worker_takes_traffic_after_cooldown(name: str) -> None:
    policy = create_policy(name)
    worker = make_worker("solo")
    worker.breaker = BreakerState.OPEN
    worker.breaker_opened_at = 1000.0
    worker.breaker_cooldown = 30.0
    with mock.patch("harmony_gateway.routing.workers.time.monotonic", return_value=1029.0):
        with pytest.raises(NoHealthyWorker):
            policy.select([worker], requests(1)[0])
    with mock.patch("harmony_gateway.routing.workers.time.monotonic", return_value=1030.0):
        assert policy.select([worker], requests(1)[0]) is worker
    assert worker.breaker is BreakerState.HALF_OPEN


def test_survives_worker_removal(name: str) -> None:
    policy = create_policy(name)
    workers = make_workers(4)
    for r in requests(40):
        policy.select(workers, r)
    policy.on_worker_removed(workers[0])
    remaining = workers[1:]
    assert all(policy.select(remaining, r) in remaining for r in requests(40))


def test_peek_names_the_next_selection_and_changes_nothing(name: str) -> None:
    """The prompt inspector's routing answer: `peek` is the worker `select` then picks, and peeking any
    number of times leaves the sequence of selections exactly as it would have been."""
    peeking = create_policy(name, seed=3) if _seeded(name) else create_policy(name)
    plain = create_policy(name, seed=3) if _seeded(name) else create_policy(name)
    workers = make_workers(4)
    for i, request in enumerate(requests(120)):
        workers[i % 4].in_flight = i % 3
        peeked = [peeking.peek(workers, request).id for _ in range(2)]
        chosen = peeking.select(workers, request).id
        assert peeked == [chosen, chosen]
        assert plain.select(workers, request).id == chosen


def _seeded(name: str) -> bool:
    return name in ("random", "power_of_two", "consistent_hash")


def test_a_tenants_cache_match_ignores_other_tenants(name: str) -> None:
    """What the inspector shows tenant B (`match_length`) for tenant A's very prompts is what it would be
    had A sent nothing: no policy lets one tenant's lookup match another's entries."""
    shared, alone = create_policy(name), create_policy(name)
    workers = make_workers(4)
    a_requests = [dataclasses.replace(r, tenant="a") for r in requests(60)]
    b_requests = [dataclasses.replace(r, tenant="b") for r in requests(120)[60:]]
    for request in a_requests + b_requests:
        shared.select(workers, request)
    for request in b_requests:
        alone.select(workers, request)
    for probe in a_requests + b_requests:
        as_b = dataclasses.replace(probe, tenant="b")
        assert shared.match_length(workers, as_b) == alone.match_length(workers, as_b)
