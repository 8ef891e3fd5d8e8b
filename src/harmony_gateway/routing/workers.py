"""Workers and the registry that holds them, grouped by the model each serves.

A `Worker` wraps one engine client with the state routing needs: health, circuit breaker, in-flight
count, and the kind (regular, prefill, decode). Policies read this state; only the pipeline and the
health checker change it. Two independent signals gate traffic: `healthy` follows the periodic health
probes (`consecutive_failures` / `consecutive_successes` count probe results), while the circuit
breaker follows real request outcomes (`breaker_failures` counts consecutive failed requests; see
`routing/health.py` `record_failure` / `record_success`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from ..engines.base import EngineClient, ModelInfo, redact_url
from ..engines.kv_events import EngineLoad


class WorkerKind(StrEnum):
    REGULAR = "regular"
    PREFILL = "prefill"
    DECODE = "decode"


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class PrefixIndex(Protocol):
    """What routing reads of the prefix index built from a worker's KV events (`routing/kv_index.py`)."""

    @property
    def complete(self) -> bool:
        """True while the index mirrors the engine's cache; False while it is partially known (a gap in
        the stream, a snapshot that misses old blocks, before the first resync): policies then fall back
        to their approximate record for this worker."""
        ...

    def matched_tokens(self, input_ids: Sequence[int], lora_name: str = "", cache_salt: str = "") -> int:
        """Tokens of the prompt's leading full blocks that the engine holds; never changes the index
        except to mark the matched blocks as used. Cheap to call again with the same `input_ids` object
        for another worker (the prompt's block hashes are computed once)."""
        ...

    def __len__(self) -> int:
        """Blocks held."""
        ...


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
    #: Consecutive failed requests; the breaker opens when this reaches the configured threshold.
    breaker_failures: int = 0
    #: Seconds an open breaker stays open before one trial request is let through (half-open).
    #: Set from `HealthConfig.breaker_cooldown` by the health checker and `record_failure`.
    breaker_cooldown: float = 30.0
    bootstrap_port: int | None = None
    engine: str = "sglang"
    #: Average seconds per generated token seen on this worker's streams (pipeline/stream_interval.py).
    token_seconds: float | None = None
    #: The engine's last load record, pushed on its KV-event stream or polled, and when it arrived
    #: (`time.monotonic()`); None until one arrives.
    engine_load: EngineLoad | None = None
    engine_load_at: float = 0.0
    #: Set while the engine reports output silence past the wedge bound with requests in flight; a
    #: wedged worker takes no traffic until a later record clears it.
    wedged: bool = False
    #: Set while the worker leaves the fleet (its address went from DNS): it takes no new request and
    #: is removed once the requests in flight finish (routing/dns_discovery.py).
    draining: bool = False
    #: The `--worker-dns` target that found the worker; None for one from the command line or the API.
    discovered_by: str | None = None
    #: The prefix index built from the worker's KV events; None for a worker that publishes none.
    kv_index: PrefixIndex | None = None
    #: Until the worker's model is known: the probes that failed in a row, the last one's reason, and
    #: when (`time.monotonic()`) the next may run; each failure doubles the wait (routing/fleet.py).
    probe_failures: int = 0
    probe_error: str = ""
    next_probe_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def public_url(self) -> str:
        """The URL without credentials: what metrics, logs and API answers show."""
        return redact_url(self.url)

    @property
    def model_id(self) -> str:
        return self.model_info.served_model_name if self.model_info else ""

    def available(self, now: float | None = None, breaker_cooldown: float | None = None) -> bool:
        """Healthy, not wedged nor draining, and the circuit breaker lets a request through.

        An open breaker half-opens (and this returns True) once `breaker_cooldown` seconds (default:
        the worker's own `breaker_cooldown`) have passed since it opened; `now` defaults to
        `time.monotonic()`. Policies call it with no arguments.
        """
        if not self.healthy or self.wedged or self.draining:
            return False
        if self.breaker is BreakerState.OPEN:
            now = time.monotonic() if now is None else now
            cooldown = self.breaker_cooldown if breaker_cooldown is None else breaker_cooldown
            if now - self.breaker_opened_at >= cooldown:
                self.breaker = BreakerState.HALF_OPEN
                return True
            return False
        return True

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.public_url,
            "kind": self.kind.value,
            "engine": self.engine,
            "model": self.model_id,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "circuit_breaker": self.breaker.value,
            "draining": self.draining,
            "discovered_by": self.discovered_by,
        }


def healthy_workers(workers: Iterable[Worker]) -> list[Worker]:
    """The workers that may take a request now (`Worker.available()`), in the given order."""
    return [w for w in workers if w.available()]
