"""KV-aware routing: price every worker by the prefill work the prompt would cost there, given what its
engine says it caches and how loaded it says it is, and send the prompt to the cheapest.

The engines' own KV events (`Worker.kv_index`) say which prompt blocks each holds, and their pushed load
records (`Worker.engine_load`) how much work each has queued and running. For a worker whose engine
publishes no events, or whose index is only partially known, the policy falls back to its own record of
what it routed (`RoutedPrompts`, as `cache_aware` keeps); for a worker with no fresh load record, to the
gateway's own in-flight count. Two spill rules, after SMG's cache-aware policy, make a worker give up
the requests its cache would draw: KV pressure and load imbalance. The cost follows NVIDIA Dynamo's KV
router (prefill left after the cached blocks, plus decode load). docs/routing.md gives the formula.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..engines.kv_events import EngineLoad
from .cache_aware import Key, RoutedPrompts, check_balance_thresholds, imbalanced
from .policy import RoutingPolicy, RoutingRequest, available_workers
from .random_policy import twin_rng
from .workers import Worker

#: Requests remembered per worker as sent since its last load record; only a burst faster than the
#: engine's records reaches it, and the oldest then stop counting.
_MAX_SENT = 4096

Spill = Literal["kv_pressure", "imbalance"]


@dataclass(frozen=True, slots=True)
class WorkerScore:
    """What the policy reads of one available worker for one request, and the cost it derives.

    `cached_tokens` is how much of the prompt the worker holds: from its engine's index
    (`cached_from="index"`) or from the policy's record of what it sent there (`"record"`); 0 when the
    worker spilled. `active` is its requests (running and waiting) and `queued_tokens` the uncached
    prompt tokens waiting ahead of this one, both from its engine's load record (`load_from="engine"`)
    plus what was sent since, or from the gateway's in-flight count (`"in_flight"`: nothing queued
    known). `kv_usage` is its KV usage (the non-evictable share when the engine reports it), None
    without a fresh record.
    """

    worker: Worker
    cached_tokens: int
    cached_from: Literal["index", "record"]
    active: int
    queued_tokens: int
    load_from: Literal["engine", "in_flight"]
    kv_usage: float | None
    spill: Spill | None
    cost: float


@dataclass(slots=True)
class _Sent:
    """What changed on a worker since its engine's load record `record`, which the next record will
    count: the requests sent there since (their uncached prompt tokens, oldest first), and how many of
    the requests the record did count have finished since (`done`). Records come a scheduler tick after
    the change, so without `done` a worker would look busy with a request it just finished."""

    record: EngineLoad
    tokens: deque[int]
    total: int = 0
    done: int = 0


@dataclass(frozen=True, slots=True)
class _Load:
    active: int
    queued_tokens: int
    kv_usage: float | None
    fresh: bool


class KvAwarePolicy(RoutingPolicy):
    """Routes each prompt to the worker where it costs least, counting the cache the engine reports.

    For the prompt's `L` tokens, each available worker `w` costs

        cost(w) = overlap_weight * (L - cached(w) + queue_weight * queued(w)) + decode_weight * active(w)

    in prompt-token equivalents: the prefill the prompt would leave on `w` (what its cache does not
    hold, behind what is already queued there) plus `decode_weight` tokens for each request already
    running or waiting there. `cached(w)` comes from `w.kv_index` when the index is complete, else from
    the policy's tenant-scoped record of the prompts it sent to `w`. `active(w)` and `queued(w)` come
    from `w.engine_load` while it is at most `load_max_age` seconds old (the record's own `age_ms`
    included), plus the requests this policy sent there since that record; `active(w)` is never below
    the gateway's `in_flight` there. Without a fresh record, `active(w)` is `in_flight` and `queued(w)`
    is 0. `queued(w)` is the record's `waiting_uncached_tokens`, else its `prefill_pending_tokens`, else
    the waiting requests times `L`.

    Spill rules, checked first, make a worker leave its affinity (its cached prefix and the
    `prompt_cache_key`s it holds stop counting for it):

    - KV pressure: its KV usage (`active_token_usage`, else `token_usage`) is above
      `kv_pressure_threshold` while another candidate's is not. It then takes the request only when
      every worker not under pressure is unavailable.
    - Imbalance: its `active` is more than `balance_abs_threshold` above the least active candidate's
      and more than `balance_rel_threshold` times it (the `cache_aware` rule, applied per worker: the
      skewed worker loses its draw, the rest keep theirs).

    A request with a `prompt_cache_key` goes to the worker its tenant last sent that key to, while that
    worker is available and did not spill. Otherwise the least cost wins; ties go to fewer active
    requests, then fewer tokens sent there, then the order given. With `temperature` > 0 the worker is
    drawn instead with probability proportional to exp(-(cost - least) / ((most - least) *
    temperature)) (costs scaled to the spread, so the knob means the same at any prompt length).

    The prompt is then recorded under the chosen worker in its tenant's namespace, as `cache_aware`
    records it (token ids only: the engines' indexes are in tokens, so `--cache-key` does not apply).
    """

    name = "kv_aware"

    def __init__(
        self,
        *,
        overlap_weight: float = 1.0,
        queue_weight: float = 0.25,
        decode_weight: float = 1024.0,
        load_max_age: float = 5.0,
        kv_pressure_threshold: float = 0.9,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        temperature: float = 0.0,
        max_tree_size: int = 2**20,
        max_cache_keys: int = 100_000,
        seed: int | None = None,
    ) -> None:
        if not overlap_weight >= 0.0:
            raise ValueError("overlap_weight must be 0 or more")
        if not queue_weight >= 0.0:
            raise ValueError("queue_weight must be 0 or more")
        if not decode_weight >= 0.0:
            raise ValueError("decode_weight must be 0 or more")
        if not load_max_age > 0.0:
            raise ValueError("load_max_age must be above 0 seconds")
        if not 0.0 <= kv_pressure_threshold <= 1.0:
            raise ValueError("kv_pressure_threshold must be between 0 and 1")
        if not temperature >= 0.0:
            raise ValueError("temperature must be 0 or more")
        check_balance_thresholds(balance_abs_threshold, balance_rel_threshold)
        self.overlap_weight = overlap_weight
        self.queue_weight = queue_weight
        self.decode_weight = decode_weight
        self.load_max_age = load_max_age
        self.kv_pressure_threshold = kv_pressure_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.temperature = temperature
        self._routed = RoutedPrompts(
            cache_key="tokens", max_tree_size=max_tree_size, max_cache_keys=max_cache_keys
        )
        self._rng = random.Random(seed)
        #: Worker id -> requests sent there since its engine's last load record.
        self._sent: dict[str, _Sent] = {}

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        key = self._routed.key(request)
        scores, keyed = self._score(workers, request, key)
        chosen = keyed or self._pick(scores, self._rng)
        self._routed.record(request, key, chosen.worker.id)
        if chosen.load_from == "engine" and chosen.worker.engine_load is not None:
            self._count_sent(chosen.worker, len(request.input_ids) - chosen.cached_tokens)
        return chosen.worker

    def peek(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        scores, keyed = self._score(workers, request, self._routed.key(request))
        return (keyed or self._pick(scores, twin_rng(self._rng))).worker

    def scores(self, workers: Sequence[Worker], request: RoutingRequest) -> list[WorkerScore]:
        """What `select` weighs for the request now: one score per available worker, in the given order.
        Changes nothing; raises `NoHealthyWorker` like `select`."""
        return self._score(workers, request, self._routed.key(request))[0]

    def match_length(self, workers: Sequence[Worker], request: RoutingRequest) -> int | None:
        """The longest prefix of the prompt this policy recorded sending to any of `workers` for the
        request's tenant, in tokens; reads without touching anything.

        Deliberately not what the engines' indexes hold. An engine's prefix cache is shared by every
        tenant whose requests it serves, so its index answers "is this prompt cached?" for prompts of
        all tenants. The prompt inspector, which any tenant may call, reports this number: were it read
        from the index, a tenant could send guesses of another tenant's prompt (a system prompt, a
        document) and learn exactly how many leading tokens of each are cached, block by block, without
        the noise a timing probe has. Selecting does read the indexes, for every tenant: that is what
        the policy is for, and it reveals no more than the engine's cache itself does.
        """
        key = self._routed.key(request)
        if not key:
            return 0
        return self._routed.tree.match(request.tenant, key, {w.id for w in workers})[0]

    def on_request_done(self, worker: Worker, request: RoutingRequest | None) -> None:
        sent = self._since_record(worker)
        if sent is None:
            return
        if sent.tokens:
            # Sent after the record, so not in it; whichever request it was, the oldest is the likeliest.
            sent.total -= sent.tokens.popleft()
        else:
            sent.done += 1  # one the record counts as running is over

    def on_worker_removed(self, worker: Worker) -> None:
        self._routed.remove_worker(worker.id)
        self._sent.pop(worker.id, None)

    def _score(
        self, workers: Sequence[Worker], request: RoutingRequest, key: Key
    ) -> tuple[list[WorkerScore], WorkerScore | None]:
        """Every available worker's score, and the score of the worker the request's `prompt_cache_key`
        holds when that decides (None otherwise). `key` is the request's key in the record."""
        candidates = available_workers(workers, request)
        prompt = len(request.input_ids)
        now = time.monotonic()
        loads = [self._load(w, prompt, now) for w in candidates]
        least_active = min(load.active for load in loads)
        relieved = any(not self._pressured(load) for load in loads)
        unindexed = {w.id for w in candidates if w.kv_index is None or not w.kv_index.complete}
        recorded = self._routed.tree.matches(request.tenant, key, unindexed) if key and unindexed else {}
        scores = []
        for worker, load in zip(candidates, loads, strict=True):
            spill: Spill | None = None
            if relieved and self._pressured(load):
                spill = "kv_pressure"
            elif imbalanced(
                load.active, least_active, self.balance_abs_threshold, self.balance_rel_threshold
            ):
                spill = "imbalance"
            index = worker.kv_index
            cached_from: Literal["index", "record"] = "record"
            if index is not None and index.complete:
                cached_from = "index"
                # The same `input_ids` object for every worker: the index hashes the prompt once.
                cached = index.matched_tokens(request.input_ids) if spill is None else 0
            else:
                cached = recorded.get(worker.id, 0) if spill is None else 0
            cached = max(0, min(cached, prompt))
            cost = (
                self.overlap_weight * (prompt - cached + self.queue_weight * load.queued_tokens)
                + self.decode_weight * load.active
            )
            scores.append(
                WorkerScore(
                    worker=worker,
                    cached_tokens=cached,
                    cached_from=cached_from,
                    active=load.active,
                    queued_tokens=load.queued_tokens,
                    load_from="engine" if load.fresh else "in_flight",
                    kv_usage=load.kv_usage,
                    spill=spill,
                    cost=cost,
                )
            )
        keyed = self._routed.keyed_worker(candidates, request)
        keyed_score = next((s for s in scores if s.worker is keyed and s.spill is None), None)
        return scores, keyed_score

    def _pressured(self, load: _Load) -> bool:
        return load.kv_usage is not None and load.kv_usage > self.kv_pressure_threshold

    def _load(self, worker: Worker, prompt: int, now: float) -> _Load:
        record = worker.engine_load
        if record is None or now - worker.engine_load_at + record.age_ms / 1000 > self.load_max_age:
            return _Load(active=worker.in_flight, queued_tokens=0, kv_usage=None, fresh=False)
        if record.waiting_uncached_tokens is not None:
            queued = record.waiting_uncached_tokens
        elif record.prefill_pending_tokens is not None:
            queued = record.prefill_pending_tokens
        else:
            queued = record.waiting_requests * prompt
        active = record.running_requests + record.waiting_requests
        sent = self._sent.get(worker.id)
        if sent is not None and sent.record is record:
            active = max(0, active + len(sent.tokens) - sent.done)
            queued += sent.total
        usage = record.active_token_usage if record.active_token_usage is not None else record.token_usage
        return _Load(active=max(active, worker.in_flight), queued_tokens=queued, kv_usage=usage, fresh=True)

    def _pick(self, scores: list[WorkerScore], rng: random.Random) -> WorkerScore:
        """The worker to take, among those not spilled by KV pressure (all of them when every one was)."""
        pool = [s for s in scores if s.spill != "kv_pressure"] or scores
        if len(pool) == 1:
            return pool[0]
        if self.temperature > 0.0:
            return self._draw(pool, rng)
        sizes = self._routed.tree.size
        return min(pool, key=lambda s: (s.cost, s.active, sizes(s.worker.id)))

    def _draw(self, pool: list[WorkerScore], rng: random.Random) -> WorkerScore:
        least = min(s.cost for s in pool)
        spread = max(s.cost for s in pool) - least
        if spread <= 0.0:
            return pool[rng.randrange(len(pool))]
        weights = [math.exp(-(s.cost - least) / (spread * self.temperature)) for s in pool]
        return rng.choices(pool, weights=weights)[0]

    def _since_record(self, worker: Worker) -> _Sent | None:
        """The changes counted against the worker's current load record (None without one)."""
        record = worker.engine_load
        if record is None:
            return None
        sent = self._sent.get(worker.id)
        if sent is None or sent.record is not record:
            sent = self._sent[worker.id] = _Sent(record, deque(maxlen=_MAX_SENT))
        return sent

    def _count_sent(self, worker: Worker, uncached: int) -> None:
        sent = self._since_record(worker)
        assert sent is not None
        if len(sent.tokens) == _MAX_SENT:
            sent.total -= sent.tokens[0]
        sent.tokens.append(uncached)
        sent.total += uncached
