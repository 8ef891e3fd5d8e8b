from __future__ import annotations

from collections import Counter

from harmony_gateway.routing import PowerOfTwoPolicy, RoutingRequest

from ._fakes import make_worker

REQUEST = RoutingRequest(model="m", input_ids=[1])


def test_two_workers_always_picks_the_less_loaded() -> None:
    policy = PowerOfTwoPolicy(seed=0)
    busy, idle = make_worker("busy", in_flight=7), make_worker("idle", in_flight=2)
    assert {policy.select([busy, idle], REQUEST).id for _ in range(100)} == {"idle"}


def test_prefers_fewer_in_flight() -> None:
    policy = PowerOfTwoPolicy(seed=42)
    workers = [
        make_worker("light", in_flight=0),
        make_worker("mid", in_flight=5),
        make_worker("heavy", in_flight=9),
    ]
    counts = Counter(policy.select(workers, REQUEST).id for _ in range(600))
    # The most loaded worker loses every pair it is drawn in; the least loaded wins every pair (2/3).
    assert counts["heavy"] == 0
    assert 340 < counts["light"] < 460
