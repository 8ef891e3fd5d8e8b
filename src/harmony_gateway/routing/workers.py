"""Workers and the registry that holds them, grouped by the model each serves.

A `Worker` wraps one engine client with the state routing needs: health, circuit breaker, in-flight
count, and the kind (regular, prefill, decode). Policies read this state; only the pipeline and the
health checker change it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..engines.base import EngineClient, ModelInfo


class WorkerKind(str, Enum):
    REGULAR = "regular"
    PREFILL = "prefill"
    DECODE = "decode"


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


_ids = itertools.count(1)


@dataclass(eq=False)
class Worker:
    url: str
    client: EngineClient
    kind: WorkerKind = WorkerKind.REGULAR
    model_info: ModelInfo | None = None
    id: str = field(default_factory=lambda: f"w{next(_ids)}")
    healthy: bool = False
    in_flight: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    breaker: BreakerState = BreakerState.CLOSED
    breaker_opened_at: float = 0.0
    bootstrap_port: int | None = None
    engine: str = "sglang"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        return self.model_info.served_model_name if self.model_info else ""

    def available(self, now: float | None = None, breaker_cooldown: float = 30.0) -> bool:
        """Healthy, and the circuit breaker lets a request through (half-opens after the cool-down)."""
        if not self.healthy:
            return False
        if self.breaker is BreakerState.OPEN:
            now = time.monotonic() if now is None else now
            if now - self.breaker_opened_at >= breaker_cooldown:
                self.breaker = BreakerState.HALF_OPEN
                return True
            return False
        return True

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "kind": self.kind.value,
            "engine": self.engine,
            "model": self.model_id,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "circuit_breaker": self.breaker.value,
        }


def healthy_workers(workers: Iterable[Worker]) -> list[Worker]:
    return [w for w in workers if w.available()]
