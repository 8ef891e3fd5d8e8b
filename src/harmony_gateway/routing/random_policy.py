"""Random: each request goes to a uniformly random available worker.

Named `random_policy.py` so it does not shadow the standard library's `random`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .policy import RoutingPolicy, RoutingRequest, available_workers
from .workers import Worker


class RandomPolicy(RoutingPolicy):
    """Picks uniformly among the available workers; `seed` makes the sequence reproducible."""

    name = "random"

    def __init__(self, *, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return self._rng.choice(available_workers(workers, request))

    def peek(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return twin_rng(self._rng).choice(available_workers(workers, request))


def twin_rng(rng: random.Random) -> random.Random:
    """A generator in the same state: its next draw is `rng`'s next draw, without advancing `rng`."""
    twin = random.Random()
    twin.setstate(rng.getstate())
    return twin
