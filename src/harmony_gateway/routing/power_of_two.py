"""Power of two choices: sample two available workers, send the request to the less busy one."""

from __future__ import annotations

import random
from collections.abc import Sequence

from .policy import RoutingPolicy, RoutingRequest, available_workers
from .random_policy import twin_rng
from .workers import Worker


class PowerOfTwoPolicy(RoutingPolicy):
    """Samples two distinct available workers at random and picks the one with fewer `in_flight`.

    Ties go to the first sampled, which is itself random. With one available worker it is returned.
    Sampling two rather than scanning all avoids herding every request onto the momentarily least
    loaded worker when `in_flight` lags behind reality.
    """

    name = "power_of_two"

    def __init__(self, *, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return self._pick(workers, request, self._rng)

    def peek(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return self._pick(workers, request, twin_rng(self._rng))

    @staticmethod
    def _pick(workers: Sequence[Worker], request: RoutingRequest, rng: random.Random) -> Worker:
        candidates = available_workers(workers, request)
        if len(candidates) == 1:
            return candidates[0]
        a, b = rng.sample(candidates, 2)
        return b if b.in_flight < a.in_flight else a
