"""The simulated engine's scheduler: admission window, prefill lane, KV reservations and load figures.

A request (`Ticket`) waits FIFO until the engine admits it: fewer than `max_running_requests` are
admitted, the prefill lane is free, and the KV cache has room for its uncached prompt and planned output
(evicting unused blocks; the head of the queue blocks the rest). Admission reads the request's cached
prefix and pins it. The lane prefills one request at a time, `prefill_ms_per_token` per uncached prompt
token; then its prompt blocks are stored and it decodes, every step of `tokens` taking
`tokens * (decode_ms_per_token + decode_ms_per_running * decoding requests)`. When it leaves, the full
blocks of its prompt and output are stored and its blocks unpinned.

There is no scheduler task: each request's own coroutine awaits its turn (a future the scheduler resolves)
and its own timers, so an idle engine costs nothing. `figures()` reads the numbers a load record and
`GetLoads` report.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .kv_cache import Block, BlockCache, chain_keys

#: How far back streamed tokens count toward the generation throughput (seconds).
THROUGHPUT_WINDOW = 2.0
#: How many admissions the cache hit rate averages over.
HIT_RATE_SAMPLES = 64


@dataclass(frozen=True, slots=True)
class Timing:
    """The timing model; all zero (the default) keeps the older pacing by `ttft_ms` and
    `tokens_per_second` alone."""

    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    decode_ms_per_running: float = 0.0

    @property
    def models_decode(self) -> bool:
        return self.decode_ms_per_token > 0 or self.decode_ms_per_running > 0


@dataclass(frozen=True, slots=True)
class LoadFigures:
    """The engine's load as its scheduler knows it now."""

    running: int
    waiting: int
    #: Prompt tokens of waiting requests not in the cache when they arrived.
    waiting_uncached_tokens: int
    #: Prompt tokens of requests without a first output yet (waiting or in prefill).
    prefill_pending_tokens: int
    #: KV tokens held: every cached block (evictable or not) and the running requests' reservations.
    used_tokens: int
    #: KV tokens eviction cannot reclaim: blocks running requests use and their reservations.
    active_tokens: int
    capacity_tokens: int
    gen_throughput: float
    cache_hit_rate: float
    max_running_requests: int
    #: Milliseconds since the last output while every-token streams are in flight; None otherwise.
    engine_silence_ms: int | None


class Ticket:
    """One request's place in the scheduler."""

    __slots__ = (
        "admitted",
        "cached_blocks",
        "decoding",
        "done",
        "est_uncached",
        "future",
        "holds_lane",
        "ids",
        "keys",
        "out_tokens",
        "pending_prefill",
        "pinned",
        "queued",
        "reports",
        "reserved",
    )

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = ids
        self.keys: list[int] = []
        self.out_tokens = 0
        self.reports = False
        self.est_uncached = 0
        self.cached_blocks = 0
        self.pinned: list[Block] = []
        self.reserved = 0
        self.future: asyncio.Future[None] | None = None
        self.queued = False
        self.admitted = False
        self.holds_lane = False
        self.decoding = False
        self.pending_prefill = False
        self.done = False


class Scheduler:
    """Admission, the prefill lane and decode timing over one `BlockCache`. `on_change` is called when
    the load may have changed (an arrival, an admission, a departure)."""

    def __init__(
        self,
        cache: BlockCache,
        timing: Timing,
        max_running: int,
        *,
        token_delay: float = 0.0,
        physical_copies: bool = False,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.cache = cache
        self.timing = timing
        self.max_running = max(1, max_running)
        self.token_delay = token_delay
        self.physical_copies = physical_copies
        self._on_change = on_change
        self.waiting: deque[Ticket] = deque()
        self.running = 0
        self.decoding = 0
        self.lane_busy = False
        self.waiting_uncached = 0
        self.prefill_pending = 0
        self.reporting = 0
        self._quiet_since = 0.0
        self.last_output = 0.0
        self._buckets: deque[list[int]] = deque()
        self._hits: deque[tuple[int, int]] = deque()
        self._hit_prompt = 0
        self._hit_cached = 0
        #: Set while nothing waits or runs.
        self.idle = asyncio.Event()
        self.idle.set()

    # -- a request's path -------------------------------------------------------------------------

    def enter(self, ticket: Ticket) -> asyncio.Future[None] | None:
        """Queue `ticket`; None when it was admitted at once, else a future resolved on admission."""
        size = self.cache.block_size
        ids = ticket.ids
        ticket.keys = chain_keys(ids, size, len(ids) // size)
        ticket.pending_prefill = True
        self.prefill_pending += len(ids)
        if ticket.reports:
            if self.reporting == 0:
                self._quiet_since = time.monotonic()
            self.reporting += 1
        if not self.waiting and self._try_admit(ticket):
            self._changed()
            return None
        usable = (len(ids) - 1) // size
        ticket.est_uncached = len(ids) - self.cache.match(ticket.keys[:usable]) * size
        ticket.queued = True
        ticket.future = asyncio.get_running_loop().create_future()
        self.waiting.append(ticket)
        self.waiting_uncached += ticket.est_uncached
        self._changed()
        return ticket.future

    def prefill_seconds(self, ticket: Ticket) -> float:
        uncached = len(ticket.ids) - ticket.cached_blocks * self.cache.block_size
        return uncached * self.timing.prefill_ms_per_token / 1000.0

    def prefilled(self, ticket: Ticket, *, aborted: bool) -> None:
        """The prefill of an admitted `ticket` ended: its prompt blocks are stored (unless aborted), the
        lane frees, and it decodes."""
        if not ticket.admitted or ticket.decoding or ticket.done:
            return
        if ticket.holds_lane:
            ticket.holds_lane = False
            self.lane_busy = False
        if not aborted:
            full = len(ticket.keys)
            cache = self.cache
            computed = full - ticket.cached_blocks
            ticket.reserved -= computed
            cache.reserved -= computed
            cache.store(ticket.ids, ticket.keys, ticket.pinned, full, copies=self.physical_copies)
            ticket.decoding = True
            self.decoding += 1
            self._first_output(ticket)
        self._pump()
        self._changed()

    def leave(self, ticket: Ticket, output: Sequence[int]) -> None:
        """`ticket` is done (finished, aborted or failed; idempotent): the full blocks of its prompt and
        `output` are stored, its blocks unpinned and its reservation returned."""
        if ticket.done:
            return
        ticket.done = True
        if ticket.queued:
            ticket.queued = False
            self.waiting.remove(ticket)
            self.waiting_uncached -= ticket.est_uncached
        self._first_output(ticket)
        if ticket.reports:
            self.reporting -= 1
        if ticket.holds_lane:
            ticket.holds_lane = False
            self.lane_busy = False
        if ticket.admitted:
            cache = self.cache
            cache.reserved -= ticket.reserved
            ticket.reserved = 0
            if ticket.decoding:
                self.decoding -= 1
                self._store_output(ticket, output)
            cache.unpin(ticket.pinned)
            ticket.pinned = []
            self.running -= 1
        self._pump()
        self._changed()

    def _store_output(self, ticket: Ticket, output: Sequence[int]) -> None:
        # The last token has no KV yet: the engine computes it when the sequence is fed back.
        if not output:
            return
        size = self.cache.block_size
        sequence = [*ticket.ids, *output]
        blocks = (len(sequence) - 1) // size
        full = len(ticket.keys)
        if blocks <= full:
            return
        parent = ticket.keys[-1] if ticket.keys else 0
        keys = ticket.keys + chain_keys(sequence, size, blocks - full, parent, full * size)
        if len(ticket.pinned) == full:
            self.cache.store(sequence, keys, ticket.pinned, blocks, copies=self.physical_copies)

    # -- admission --------------------------------------------------------------------------------

    def _try_admit(self, ticket: Ticket) -> bool:
        if self.running >= self.max_running or self.lane_busy:
            return False
        cache = self.cache
        size = cache.block_size
        prompt = len(ticket.ids)
        cached = cache.match(ticket.keys[: (prompt - 1) // size])
        pinned = cache.pin(ticket.keys[:cached])
        need = -(-(prompt + ticket.out_tokens) // size) - cached
        # An engine with nothing running takes the request even when it does not fit: nothing would
        # ever free the room it waits for.
        if not cache.make_room(need) and self.running > 0:
            cache.unpin(pinned)
            return False
        cache.reserved += need
        ticket.reserved = need
        ticket.pinned = pinned
        ticket.cached_blocks = cached
        ticket.admitted = True
        self.running += 1
        self._sample_hit(prompt, cached * size)
        if self.timing.prefill_ms_per_token > 0:
            ticket.holds_lane = True
            self.lane_busy = True
        return True

    def _pump(self) -> None:
        while self.waiting:
            head = self.waiting[0]
            if not self._try_admit(head):
                return
            self.waiting.popleft()
            head.queued = False
            self.waiting_uncached -= head.est_uncached
            if head.future is not None and not head.future.done():
                head.future.set_result(None)

    def _first_output(self, ticket: Ticket) -> None:
        if ticket.pending_prefill:
            ticket.pending_prefill = False
            self.prefill_pending -= len(ticket.ids)

    def _changed(self) -> None:
        if self.busy:
            self.idle.clear()
        else:
            self.idle.set()
        if self._on_change is not None:
            self._on_change()

    # -- timing and figures -----------------------------------------------------------------------

    def step_seconds(self, tokens: int) -> float:
        """How long a decode step emitting `tokens` per request takes now."""
        timing = self.timing
        if timing.models_decode:
            per_token = timing.decode_ms_per_token + timing.decode_ms_per_running * self.decoding
            return tokens * per_token / 1000.0
        return tokens * self.token_delay

    def note_output(self, tokens: int) -> None:
        """The engine produced output (tokens, or a completion when 0)."""
        now = time.monotonic()
        self.last_output = now
        if tokens <= 0:
            return
        bucket = int(now * 10)
        buckets = self._buckets
        if buckets and buckets[-1][0] == bucket:
            buckets[-1][1] += tokens
        else:
            buckets.append([bucket, tokens])

    def _sample_hit(self, prompt: int, cached: int) -> None:
        if prompt <= 0:
            return
        self._hits.append((prompt, cached))
        self._hit_prompt += prompt
        self._hit_cached += cached
        if len(self._hits) > HIT_RATE_SAMPLES:
            old_prompt, old_cached = self._hits.popleft()
            self._hit_prompt -= old_prompt
            self._hit_cached -= old_cached

    @property
    def busy(self) -> bool:
        return self.running > 0 or bool(self.waiting)

    def gen_throughput(self) -> float:
        oldest = int((time.monotonic() - THROUGHPUT_WINDOW) * 10)
        buckets = self._buckets
        while buckets and buckets[0][0] < oldest:
            buckets.popleft()
        return sum(tokens for _, tokens in buckets) / THROUGHPUT_WINDOW

    def figures(self) -> LoadFigures:
        cache = self.cache
        size = cache.block_size
        silence: int | None = None
        if self.reporting > 0:
            since = max(self.last_output, self._quiet_since)
            silence = int((time.monotonic() - since) * 1000)
        return LoadFigures(
            running=self.running,
            waiting=len(self.waiting),
            waiting_uncached_tokens=self.waiting_uncached,
            prefill_pending_tokens=self.prefill_pending,
            used_tokens=(cache.physical + cache.reserved) * size,
            active_tokens=(cache.pinned_physical + cache.reserved) * size,
            capacity_tokens=cache.capacity_blocks * size,
            gen_throughput=self.gen_throughput(),
            cache_hit_rate=self._hit_cached / self._hit_prompt if self._hit_prompt else 0.0,
            max_running_requests=self.max_running,
            engine_silence_ms=silence,
        )


__all__ = ["HIT_RATE_SAMPLES", "THROUGHPUT_WINDOW", "LoadFigures", "Scheduler", "Ticket", "Timing"]
