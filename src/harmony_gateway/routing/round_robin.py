"""Round robin: each request goes to the next available worker in turn."""

from __future__ import annotations

from collections.abc import Sequence

from .policy import RoutingPolicy, RoutingRequest, available_workers
from .workers import Worker


class RoundRobinPolicy(RoutingPolicy):
    """Cycles through the available workers in the order given.

    One counter serves every worker set, so when availability changes the cycle continues from the
    current position over the new set rather than restarting.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        candidates = available_workers(workers, request)
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return worker

    def peek(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        candidates = available_workers(workers, request)
        return candidates[self._next % len(candidates)]
