"""`SubscribeKvEvents` of the simulated engine, served as smg-grpc-servicer's relay serves it.

`KvRelay` plays both the engine's ZMQ publisher and the servicer's relay in front of it:

- The cache's changes (`kv_cache.KvChange`) made in one event-loop turn form one batch (one scheduler
  step), numbered from 0 on data-parallel rank 0 (`dp_rank` on every batch). SGLang and TokenSpeed
  engines publish an `AllBlocksCleared` as their first batch, vLLM and TRT-LLM start with their first
  store. Event ids count up per relay; snapshot events carry 0.
- The last `history` batches are kept (within `HISTORY_BLOCKS` blocks listed). `start_sequence_number` is the last sequence the subscriber
  applied: inside the window the batches after it come first, then live ones; a cursor past the newest
  batch, below the window, or with nothing kept yet is refused with OUT_OF_RANGE (the subscriber clears
  and resubscribes from zero). Zero means no cursor: the whole history while it still starts at the
  publisher's first batch, else a snapshot of the live blocks (chunks of 2,048 physical blocks with
  consecutive sequences ending at the last batch, chunk 0 beginning with `AllBlocksCleared`, parents
  before children, one event per extra physical copy), then live batches with no gap; before any batch,
  live only.
- Every batch carries the engine's load record (`EngineLoad`, the figures `GetLoads` answers with),
  numbered by `sample` per stream, the telemetry (hit rate, token counts) only on the stream's first
  record and on `load_only` batches. A `load_only` batch repeats the last sequence sent: it goes out when
  the record changed (checked every `load_tick` while the engine is busy or after a change) and as a
  heartbeat after `heartbeat` seconds of silence, `backoff` once two heartbeats in a row were unchanged.
  Before its first batch a stream sends none, unless the request sets `load_records_before_first_batch`:
  then records numbered 0 flow from the subscription on.
- A subscriber that falls `LIVE_LIMIT` batches behind is refilled from the history, or ends with
  DATA_LOSS when the history no longer reaches back; a publisher restart ends every stream with
  DATA_LOSS; `drop_subscriptions` ends them with the status a test asks for.

Frames are serialized once per batch; a stream appends its load record as field 8 (concatenated protobuf
messages merge), so the servicers register this RPC with a serializer that passes bytes through.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from smg_grpc_proto.generated import common_pb2

from .kv_cache import Block, BlockCache, ClearedAll, KvChange, RemovedBlocks, StoredRun
from .scheduler import LoadFigures

#: Batches a slow subscriber may fall behind before it is refilled from the history.
LIVE_LIMIT = 4096
#: Physical blocks per snapshot chunk (doubled when the sequences behind the cut are too few).
CHUNK_BLOCKS = 2048
DEFAULT_HISTORY = 10_000
#: The history's second bound, in blocks its batches list (the relay's byte budget, in this twin's
#: terms: about 60 MB of token ids at 16 tokens a block).
HISTORY_BLOCKS = 262_144
_U32 = (1 << 32) - 1

Publisher = Literal["sglang", "vllm", "trtllm", "tokenspeed"]


@dataclass(frozen=True, slots=True)
class RelayTiming:
    """The load-record cadence, in seconds (the servicer's defaults)."""

    load_tick: float = 0.1
    heartbeat: float = 1.0
    backoff: float = 5.0


def varint(value: int) -> bytes:
    """`value` as a protobuf base-128 varint (the length prefix of a pre-serialized field)."""
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _with_load(frame: bytes, record: common_pb2.EngineLoad) -> bytes:
    """`frame` (a `KvEventBatch` without `load`) with `record` as its field 8."""
    data = record.SerializeToString()
    return frame + b"\x42" + varint(len(data)) + data


class _Shape:
    """How one engine's events read once the relay normalized them."""

    def __init__(self, publisher: Publisher, block_size: int) -> None:
        self.block_size = block_size
        self.groups = publisher == "vllm"

    def stored(self, parent: int | None, hashes: Sequence[int], tokens: Iterable[Sequence[int]]) -> Any:
        size = self.block_size
        stored = common_pb2.KvBlocksStored(
            blocks=[
                common_pb2.KvBlock(block_hash=h, token_ids=t, block_size=size)
                for h, t in zip(hashes, tokens, strict=True)
            ],
            tier=common_pb2.KV_CACHE_TIER_DEVICE,
            medium="GPU",
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
        )
        if parent is not None:
            stored.parent_block_hash = parent
        if self.groups:
            stored.group_idx = 0
            stored.kv_cache_spec_kind = "full_attention"
        return stored

    def removed(self, hashes: Sequence[int]) -> Any:
        removed = common_pb2.KvBlocksRemoved(
            block_hashes=hashes,
            tier=common_pb2.KV_CACHE_TIER_DEVICE,
            medium="GPU",
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
        )
        if self.groups:
            removed.group_idx = 0
        return removed

    def event(self, event_id: int, change: KvChange) -> common_pb2.KvCacheEvent:
        if isinstance(change, StoredRun):
            return common_pb2.KvCacheEvent(
                event_id=event_id, stored=self.stored(change.parent_hash, change.hashes, change.tokens)
            )
        if isinstance(change, RemovedBlocks):
            return common_pb2.KvCacheEvent(event_id=event_id, removed=self.removed(change.hashes))
        return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


class _Entry:
    """One published batch; its frame is built when a subscriber first needs it."""

    __slots__ = ("_frame", "blocks", "changes", "first_event_id", "seq", "timestamp")

    def __init__(self, seq: int, changes: tuple[KvChange, ...], first_event_id: int) -> None:
        self.seq = seq
        self.timestamp = time.time()
        self.changes = changes
        self.first_event_id = first_event_id
        self.blocks = sum(len(c.hashes) for c in changes if not isinstance(c, ClearedAll))
        self._frame: bytes | None = None

    def frame(self, shape: _Shape) -> bytes:
        if self._frame is None:
            batch = common_pb2.KvEventBatch(
                sequence_number=self.seq,
                timestamp=self.timestamp,
                events=[shape.event(self.first_event_id + i, c) for i, c in enumerate(self.changes)],
                dp_rank=0,
            )
            self._frame = batch.SerializeToString()
        return self._frame


def token_usage(figures: LoadFigures, publisher: str) -> tuple[float, float]:
    """`(token_usage, active_token_usage)`: TokenSpeed counts retained prefix cache in its usage and
    reports the non-evictable part apart; SGLang and vLLM report the non-evictable part as the usage."""
    capacity = figures.capacity_tokens or 1
    active = figures.active_tokens / capacity
    return (figures.used_tokens / capacity if publisher == "tokenspeed" else active), active


def load_record(figures: LoadFigures, publisher: str) -> common_pb2.EngineLoad:
    """The servicer's load record for `figures`, telemetry included."""
    usage, active = token_usage(figures, publisher)
    record = common_pb2.EngineLoad(
        running_requests=figures.running,
        waiting_requests=figures.waiting,
        waiting_uncached_tokens=min(figures.waiting_uncached_tokens, _U32),
        token_usage=usage,
        gen_throughput=figures.gen_throughput,
        max_running_requests=figures.max_running_requests,
        cache_hit_rate=figures.cache_hit_rate,
        num_used_tokens=int(usage * figures.capacity_tokens),
        max_total_num_tokens=figures.capacity_tokens,
        prefill_pending_tokens=min(figures.prefill_pending_tokens, _U32),
    )
    if publisher == "tokenspeed":
        record.active_token_usage = active
    if figures.engine_silence_ms is not None:
        record.engine_silence_ms = min(figures.engine_silence_ms, _U32)
    return record


_TELEMETRY = ("cache_hit_rate", "num_used_tokens", "max_total_num_tokens")


def _optional(record: common_pb2.EngineLoad, name: str) -> int | float | None:
    value: int | float | None = getattr(record, name) if record.HasField(name) else None
    return value


def load_changed(last: common_pb2.EngineLoad, current: common_pb2.EngineLoad) -> bool:
    """Whether the record moved enough for a `load_only` batch: any count, queue or window change, KV
    usage by half a percent, the rate by 5 % or 50 tokens/s, the engine's silence by a whole second,
    the pending prefill."""
    if (
        last.running_requests != current.running_requests
        or last.waiting_requests != current.waiting_requests
        or _optional(last, "waiting_uncached_tokens") != _optional(current, "waiting_uncached_tokens")
        or last.max_running_requests != current.max_running_requests
        or abs(last.token_usage - current.token_usage) > 0.005
        or _optional(last, "prefill_pending_tokens") != _optional(current, "prefill_pending_tokens")
    ):
        return True
    last_active = _optional(last, "active_token_usage")
    current_active = _optional(current, "active_token_usage")
    if abs((last_active or last.token_usage) - (current_active or current.token_usage)) > 0.005:
        return True
    silence = (_optional(last, "engine_silence_ms"), _optional(current, "engine_silence_ms"))
    if (None if silence[0] is None else int(silence[0]) // 1000) != (
        None if silence[1] is None else int(silence[1]) // 1000
    ):
        return True
    delta = abs(last.gen_throughput - current.gen_throughput)
    return delta > 50.0 or delta > 0.05 * max(last.gen_throughput, current.gen_throughput)


class _Subscriber:
    """One `SubscribeKvEvents` stream's state."""

    __slots__ = (
        "backlog",
        "before_first",
        "dirty",
        "drop",
        "idle_heartbeats",
        "lagged",
        "last_check",
        "last_record",
        "last_sent",
        "last_sent_at",
        "sample",
        "wake",
    )

    def __init__(self, before_first: bool) -> None:
        #: History entries, then live ones; or snapshot chunks as (sequence, frame).
        self.backlog: deque[_Entry | tuple[int, bytes]] = deque()
        self.before_first = before_first
        self.last_sent: int | None = None
        self.last_record: common_pb2.EngineLoad | None = None
        now = time.monotonic()
        self.last_sent_at = now
        self.last_check = now
        self.idle_heartbeats = 0
        self.sample = 0
        self.dirty = False
        self.lagged = False
        self.drop: tuple[grpc.StatusCode, str] | None = None
        self.wake = asyncio.Event()


class KvRelay:
    """The engine's KV-event publisher and the relay's history, snapshots and streams."""

    def __init__(
        self,
        publisher: Publisher,
        *,
        block_size: int,
        history: int = DEFAULT_HISTORY,
        timing: RelayTiming | None = None,
    ) -> None:
        self.publisher = publisher
        self.timing = timing or RelayTiming()
        self._shape = _Shape(publisher, block_size)
        self._history: deque[_Entry] = deque()
        self._history_batches = max(1, history)
        self._history_blocks = 0
        self._pending: list[KvChange] = []
        self._flush_scheduled = False
        self._next_seq = 0
        self._event_ids = itertools.count(1)
        self._subscribers: set[_Subscriber] = set()
        self._cache: BlockCache | None = None
        self._figures: Callable[[], LoadFigures] | None = None
        self._busy: Callable[[], bool] = lambda: False
        #: Batches published since the start (every incarnation).
        self.published = 0
        #: The `start_sequence_number` of every subscription, in arrival order (tests read resumes).
        self.requested_starts: list[int] = []

    def attach(self, cache: BlockCache, figures: Callable[[], LoadFigures], busy: Callable[[], bool]) -> None:
        """Where snapshots and load records come from."""
        self._cache = cache
        self._figures = figures
        self._busy = busy

    @property
    def startup_clear(self) -> bool:
        """SGLang's radix cache publishes a clear when it starts; TokenSpeed's follows SGLang."""
        return self.publisher in ("sglang", "tokenspeed")

    @property
    def subscriptions(self) -> int:
        return len(self._subscribers)

    @property
    def last_sequence(self) -> int | None:
        """The sequence of the last batch published (pending changes published first)."""
        self.flush()
        return self._history[-1].seq if self._history else None

    # -- publishing -------------------------------------------------------------------------------

    def emit(self, change: KvChange) -> None:
        """Queue a change for the batch of this event-loop turn."""
        self._pending.append(change)
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Publish the queued changes as one batch."""
        self._flush_scheduled = False
        if not self._pending:
            return
        changes = tuple(self._pending)
        self._pending.clear()
        first_id = next(self._event_ids)
        for _ in range(len(changes) - 1):
            next(self._event_ids)
        entry = _Entry(self._next_seq, changes, first_id)
        self._next_seq += 1
        self.published += 1
        history = self._history
        history.append(entry)
        self._history_blocks += entry.blocks
        while len(history) > 1 and (
            len(history) > self._history_batches or self._history_blocks > HISTORY_BLOCKS
        ):
            self._history_blocks -= history.popleft().blocks
        for subscriber in self._subscribers:
            if subscriber.lagged:
                continue
            subscriber.backlog.append(entry)
            if len(subscriber.backlog) > LIVE_LIMIT:
                subscriber.backlog.clear()
                subscriber.lagged = True
            subscriber.wake.set()

    def poke(self) -> None:
        """The load may have changed: streams check their record at their next tick."""
        for subscriber in self._subscribers:
            subscriber.dirty = True
            subscriber.wake.set()

    def drop_subscriptions(self, code: grpc.StatusCode, message: str) -> int:
        """End every live stream with `code`; returns how many."""
        for subscriber in self._subscribers:
            subscriber.drop = (code, message)
            subscriber.wake.set()
        return len(self._subscribers)

    def restart(self) -> None:
        """A new publisher incarnation: the history goes, sequences start over at 0, live streams end
        with DATA_LOSS (the caller empties the cache)."""
        self._pending.clear()
        self._history.clear()
        self._history_blocks = 0
        self._next_seq = 0
        self.drop_subscriptions(
            grpc.StatusCode.DATA_LOSS, "the KV event publisher restarted; resubscribe from zero"
        )

    # -- a stream ---------------------------------------------------------------------------------

    def _begin(self, subscriber: _Subscriber, cursor: int) -> str | None:
        """Fill the stream's backlog for `cursor`; the OUT_OF_RANGE message when it cannot be served."""
        self.flush()
        history = self._history
        if cursor == 0:
            if history and history[0].seq == 0:
                subscriber.backlog.extend(history)
            elif history:
                subscriber.backlog.extend(self._snapshot(history[-1].seq))
            return None
        if not history:
            return "the relay holds no KV event history yet; resubscribe from zero"
        oldest, newest = history[0].seq, history[-1].seq
        if cursor > newest:
            return (
                f"cursor {cursor} is beyond the publisher's last sequence {newest}: the publisher "
                "restarted; resubscribe from zero"
            )
        if cursor + 1 < oldest:
            return (
                f"the relay keeps history from sequence {oldest}, after cursor {cursor}; resubscribe "
                "from zero for a state snapshot"
            )
        subscriber.backlog.extend(itertools.islice(history, cursor + 1 - oldest, None))
        subscriber.last_sent = cursor
        return None

    def _snapshot(self, through: int) -> list[tuple[int, bytes]]:
        """The live blocks as chunks stamped `through - count + 1 .. through`."""
        assert self._cache is not None
        units: list[Block] = []
        for block in self._cache.blocks():
            units.extend([block] * block.copies)
        chunk = CHUNK_BLOCKS
        while max(1, -(-len(units) // chunk)) > through + 1 and chunk < len(units):
            chunk *= 2
        count = max(1, -(-len(units) // chunk))
        timestamp = time.time()
        chunks: list[tuple[int, bytes]] = []
        for index in range(count):
            events: list[common_pb2.KvCacheEvent] = []
            if index == 0:
                events.append(common_pb2.KvCacheEvent(event_id=0, cleared=common_pb2.KvCacheCleared()))
            events.extend(self._stored_runs(units[index * chunk : (index + 1) * chunk]))
            seq = through - count + 1 + index
            batch = common_pb2.KvEventBatch(
                sequence_number=seq,
                timestamp=timestamp,
                events=events,
                dp_rank=0,
                snapshot=common_pb2.KvSnapshotChunk(
                    index=index, count=count, blocks=len(units), unknown_before=0
                ),
            )
            chunks.append((seq, batch.SerializeToString()))
        return chunks

    def _stored_runs(self, units: list[Block]) -> list[common_pb2.KvCacheEvent]:
        """Stores for `units` in order: a run of blocks chaining one from the other becomes one event;
        every copy of a block held twice is an event of its own."""
        events: list[common_pb2.KvCacheEvent] = []
        start = 0
        while start < len(units):
            end = start + 1
            if units[start].copies == 1:
                while end < len(units) and units[end].copies == 1 and units[end].parent is units[end - 1]:
                    end += 1
            run = units[start:end]
            parent = run[0].parent
            stored = self._shape.stored(
                parent.hash if parent is not None else None,
                [block.hash for block in run],
                [block.tokens for block in run],
            )
            events.append(common_pb2.KvCacheEvent(event_id=0, stored=stored))
            start = end
        return events

    def _current(self) -> common_pb2.EngineLoad | None:
        return None if self._figures is None else load_record(self._figures(), self.publisher)

    @staticmethod
    def _numbered(
        subscriber: _Subscriber, current: common_pb2.EngineLoad, *, load_only: bool
    ) -> common_pb2.EngineLoad:
        """`current` as the stream's next record: numbered, and trimmed to the routing core on an event
        batch after the first."""
        subscriber.last_record = current
        subscriber.sample += 1
        record = common_pb2.EngineLoad()
        record.CopyFrom(current)
        record.sample = subscriber.sample
        record.load_only = load_only
        if not load_only and subscriber.sample > 1:
            for name in _TELEMETRY:
                record.ClearField(name)
        return record

    def _stamped(self, subscriber: _Subscriber, seq: int, frame: bytes) -> bytes:
        subscriber.last_sent = seq
        subscriber.last_sent_at = time.monotonic()
        subscriber.idle_heartbeats = 0
        current = self._current()
        if current is None:
            return frame
        return _with_load(frame, self._numbered(subscriber, current, load_only=False))

    def _load_only(self, subscriber: _Subscriber, *, force: bool = False) -> bytes | None:
        """A `load_only` batch when the record changed or a heartbeat is due (or `force`)."""
        if subscriber.last_sent is None and not subscriber.before_first:
            return None
        current = self._current()
        if current is None:
            return None
        now = time.monotonic()
        last = subscriber.last_record
        changed = last is None or load_changed(last, current)
        due = self.timing.backoff if subscriber.idle_heartbeats >= 2 else self.timing.heartbeat
        if not (force or changed or now - subscriber.last_sent_at >= due):
            return None
        record = self._numbered(subscriber, current, load_only=True)
        subscriber.last_sent_at = now
        subscriber.idle_heartbeats = 0 if changed else subscriber.idle_heartbeats + 1
        batch = common_pb2.KvEventBatch(
            sequence_number=subscriber.last_sent or 0, timestamp=time.time(), dp_rank=0, load=record
        )
        return batch.SerializeToString()

    def _deadline(self, subscriber: _Subscriber) -> float | None:
        """When the stream next looks at its load record (monotonic seconds), or None: not before a
        batch arrives."""
        if self._figures is None or (subscriber.last_sent is None and not subscriber.before_first):
            return None
        if subscriber.dirty or self._busy():
            return subscriber.last_check + self.timing.load_tick
        due = self.timing.backoff if subscriber.idle_heartbeats >= 2 else self.timing.heartbeat
        return subscriber.last_sent_at + due

    async def serve(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        """One `SubscribeKvEvents` call: backlog (history or snapshot), then live batches and records."""
        subscriber = _Subscriber(request.load_records_before_first_batch)
        self.requested_starts.append(request.start_sequence_number)
        refused = self._begin(subscriber, request.start_sequence_number)
        if refused is not None:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, refused)
            return
        self._subscribers.add(subscriber)
        try:
            if subscriber.before_first and not subscriber.backlog:
                first = self._load_only(subscriber, force=True)
                if first is not None:
                    yield first
            while True:
                if subscriber.drop is not None:
                    await context.abort(*subscriber.drop)
                    return
                if subscriber.lagged:
                    self._refill(subscriber)
                    if subscriber.drop is not None:
                        continue
                if subscriber.backlog:
                    item = subscriber.backlog.popleft()
                    if isinstance(item, _Entry):
                        if subscriber.last_sent is not None and item.seq <= subscriber.last_sent:
                            continue
                        yield self._stamped(subscriber, item.seq, item.frame(self._shape))
                    else:
                        yield self._stamped(subscriber, item[0], item[1])
                    continue
                deadline = self._deadline(subscriber)
                now = time.monotonic()
                if deadline is None or deadline > now:
                    subscriber.wake.clear()
                    try:
                        async with asyncio.timeout(None if deadline is None else deadline - now):
                            await subscriber.wake.wait()
                        continue
                    except TimeoutError:
                        pass
                subscriber.last_check = time.monotonic()
                subscriber.dirty = False
                batch = self._load_only(subscriber)
                if batch is not None:
                    yield batch
        finally:
            self._subscribers.discard(subscriber)

    def _refill(self, subscriber: _Subscriber) -> None:
        subscriber.lagged = False
        last = subscriber.last_sent
        history = self._history
        if last is not None and history and history[0].seq <= last + 1 <= history[-1].seq + 1:
            subscriber.backlog.extend(itertools.islice(history, last + 1 - history[0].seq, None))
            return
        subscriber.drop = (
            grpc.StatusCode.DATA_LOSS,
            "the subscriber fell behind and the KV event history no longer reaches back; resubscribe "
            "from zero",
        )


__all__ = [
    "CHUNK_BLOCKS",
    "DEFAULT_HISTORY",
    "HISTORY_BLOCKS",
    "LIVE_LIMIT",
    "KvRelay",
    "Publisher",
    "RelayTiming",
    "load_changed",
    "load_record",
    "token_usage",
]


def scheduler_load(pb: Any, figures: LoadFigures, publisher: str) -> Any:
    """Rank 0's `SchedulerLoad` of GetLoads in the SGLang or vLLM proto module `pb` (their messages are
    spelled alike), from the figures the load records carry too."""
    usage, _ = token_usage(figures, publisher)
    return pb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=figures.running,
        num_waiting_reqs=figures.waiting,
        num_total_reqs=figures.running + figures.waiting,
        num_used_tokens=int(usage * figures.capacity_tokens),
        max_total_num_tokens=figures.capacity_tokens,
        token_usage=usage,
        gen_throughput=figures.gen_throughput,
        cache_hit_rate=figures.cache_hit_rate,
        utilization=usage,
        max_running_requests=figures.max_running_requests,
        num_waiting_uncached_tokens=figures.waiting_uncached_tokens,
    )
