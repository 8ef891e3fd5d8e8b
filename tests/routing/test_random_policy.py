from __future__ import annotations

from collections import Counter

from harmony_gateway.routing import RandomPolicy, RoutingRequest

from ._fakes import make_workers

REQUEST = RoutingRequest(model="m", input_ids=[1])


def test_spreads_over_all_workers() -> None:
    policy = RandomPolicy(seed=1)
    workers = make_workers(4)
    counts = Counter(policy.select(workers, REQUEST).id for _ in range(2000))
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert all(400 < c < 600 for c in counts.values())


def test_seed_makes_choices_reproducible() -> None:
    workers = make_workers(5)
    a, b = RandomPolicy(seed=3), RandomPolicy(seed=3)
    assert [a.select(workers, REQUEST).id for _ in range(50)] == [
        b.select(workers, REQUEST).id for _ in range(50)
    ]
