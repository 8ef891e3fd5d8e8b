from __future__ import annotations

from harmony_gateway.routing import RoundRobinPolicy, RoutingRequest

from ._fakes import make_workers

REQUEST = RoutingRequest(model="m", input_ids=[1, 2, 3])


def test_cycles_through_workers_in_order() -> None:
    policy = RoundRobinPolicy()
    workers = make_workers(3)
    assert [policy.select(workers, REQUEST).id for _ in range(7)] == [
        "w0",
        "w1",
        "w2",
        "w0",
        "w1",
        "w2",
        "w0",
    ]


def test_skips_unavailable_workers() -> None:
    policy = RoundRobinPolicy()
    workers = make_workers(3)
    workers[1].healthy = False
    assert [policy.select(workers, REQUEST).id for _ in range(4)] == ["w0", "w2", "w0", "w2"]
