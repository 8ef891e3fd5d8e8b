"""Consistent hashing: requests with the same routing key stick to one worker.

Keys come from `RoutingRequest.cache_key` (the client's `prompt_cache_key`) when given, else
`RoutingRequest.routing_key` (session header, `user`, a Responses chain's root or conversation id),
hashed inside the request's tenant namespace: a tenant that sends another's key lands where any other
key of its own would, not on the other tenant's worker. The ring is built over worker URLs with virtual
nodes: unlike the process-local worker ids, a URL names the same engine in every gateway process and
after a restart, so all of them map a key to the same worker (and its KV cache). Adding or removing one
of N workers moves only about 1/N of the keys, and a worker that becomes unavailable hands its keys to
the next worker clockwise while every other key stays put.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Sequence

from .policy import RoutingPolicy, RoutingRequest, available_workers, tenant_key
from .random_policy import twin_rng
from .workers import Worker

# Rings for this many distinct worker sets are kept (one per model in practice); beyond that the
# oldest is rebuilt on demand.
_MAX_CACHED_RINGS = 64


def _hash(text: str) -> int:
    # A stable hash (not `hash()`, which is salted per process) so every gateway replica maps a key to
    # the same worker.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class _Ring:
    __slots__ = ("hashes", "owners")

    def __init__(self, worker_urls: Sequence[str], virtual_nodes: int) -> None:
        points = sorted((_hash(f"{url}#{i}"), url) for url in worker_urls for i in range(virtual_nodes))
        self.hashes = [h for h, _ in points]
        self.owners = [url for _, url in points]


class ConsistentHashPolicy(RoutingPolicy):
    """Maps `routing_key` onto a hash ring of worker URLs; requests without a key go to the least loaded.

    The ring spans every worker given (available or not) and the lookup walks clockwise to the first
    available one, so health flaps never rebuild the ring nor move keys of healthy workers. Lookup is
    O(log(N * virtual_nodes)) plus the walk past unavailable workers; a ring is built once per distinct
    set of worker URLs (URLs are unique within a pool). Ties in the keyless fallback are broken at random (`seed` for tests).
    """

    name = "consistent_hash"

    def __init__(self, *, virtual_nodes: int = 160, seed: int | None = None) -> None:
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be at least 1")
        self.virtual_nodes = virtual_nodes
        self._rng = random.Random(seed)
        self._rings: dict[frozenset[str], _Ring] = {}

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return self._pick(workers, request, self._rng)

    def peek(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return self._pick(workers, request, twin_rng(self._rng))

    def _pick(self, workers: Sequence[Worker], request: RoutingRequest, rng: random.Random) -> Worker:
        candidates = available_workers(workers, request)
        key = request.cache_key or request.routing_key
        if key is None:
            least = min(w.in_flight for w in candidates)
            return rng.choice([w for w in candidates if w.in_flight == least])
        by_url = {w.url: w for w in candidates}
        ring = self._ring([w.url for w in workers])
        start = bisect.bisect_right(ring.hashes, _hash(tenant_key(request.tenant, key)))
        n = len(ring.owners)
        for offset in range(n):
            worker = by_url.get(ring.owners[(start + offset) % n])
            if worker is not None:
                return worker
        raise AssertionError("unreachable: every available worker is on the ring")

    def on_worker_removed(self, worker: Worker) -> None:
        self._rings = {urls: ring for urls, ring in self._rings.items() if worker.url not in urls}

    def _ring(self, worker_urls: list[str]) -> _Ring:
        key = frozenset(worker_urls)
        ring = self._rings.get(key)
        if ring is None:
            if len(self._rings) >= _MAX_CACHED_RINGS:
                del self._rings[next(iter(self._rings))]
            ring = self._rings[key] = _Ring(sorted(key), self.virtual_nodes)
        return ring
