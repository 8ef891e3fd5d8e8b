"""The routing seam: what a policy is given (`RoutingRequest`) and what it must do (`RoutingPolicy`).

A policy picks one worker for one request among the workers the pipeline offers (already narrowed to the
request's model). It only reads worker state; the pipeline owns `in_flight` and the health checker owns
health and the breaker. Every entry a policy keeps about requests (prefix index, affinity keys) lives in
the request's tenant namespace (`RoutingRequest.tenant`, `tenant_key`), so one tenant's lookup never
matches another's entries. Adding a policy is one file plus one line in `routing/registry.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import NoHealthyWorker
from .workers import Worker


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a policy may look at to place a request.

    `selection_text` is the last user message. `routing_key` is the caller's affinity key: an
    `x-session-id`-style header when present, else the request's `user` field, else the conversation id;
    None when the request carries none of them. `cache_key` is the client's `prompt_cache_key` (Codex
    sends one per session): the key under which the client expects its prompt prefix to be cached.
    `tenant` is the request's tenant (`RequestContext.owner`; "" on an open gateway): the namespace of
    everything a policy records or looks up for the request, so identical prompts or keys of two
    tenants never share an entry.
    """

    model: str
    input_ids: Sequence[int]
    selection_text: str = ""
    routing_key: str | None = None
    request_id: str = ""
    cache_key: str | None = None
    tenant: str = ""


class RoutingPolicy(Protocol):
    """Chooses a worker for each request.

    `select` considers only workers whose `available()` is true, returns one of the given worker
    objects, and raises `NoHealthyWorker` when none is available (including an empty sequence). It runs
    on the event loop, so it must not block. Implementations may subclass this protocol to inherit the
    no-op hooks.
    """

    name: str

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker: ...

    def peek(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        """The worker `select` would pick now, changing nothing (no counter, cache or random state
        moves): the prompt inspector explains routing with it. Raises like `select`."""
        ...

    def match_length(self, workers: Sequence[Worker], request: RoutingRequest) -> int | None:
        """How much of the request's prefix the worker `peek` picks is known to hold (cache-aware
        policies; None for policies that keep no such record). Reads, never changes, the policy's state."""
        return None

    def on_request_done(self, worker: Worker, request: RoutingRequest | None) -> None:
        """Called once the request placed on `worker` has finished, successfully or not."""
        return None

    def on_worker_removed(self, worker: Worker) -> None:
        """Called when `worker` leaves the registry, so per-worker state can be dropped."""
        return None


def tenant_key(tenant: str, key: str) -> str:
    """`key` inside `tenant`'s namespace: distinct tenants never give the same string (the tenant's
    length comes first, so no choice of key can spell another tenant's prefix)."""
    return f"{len(tenant)}:{tenant}:{key}"


def available_workers(workers: Sequence[Worker], request: RoutingRequest) -> list[Worker]:
    """The available workers in the given order; raises `NoHealthyWorker` when there are none."""
    candidates = [w for w in workers if w.available()]
    if not candidates:
        raise NoHealthyWorker(
            f"no healthy worker for model {request.model!r} ({len(workers)} registered, none available)"
        )
    return candidates
