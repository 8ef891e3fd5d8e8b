"""What an engine publishes about its KV cache and its load, in the gateway's own terms.

The SGLang, vLLM, TRT-LLM and TokenSpeed wires carry `SubscribeKvEvents`: a server stream of
`KvEventBatch` messages (smg-grpc-proto `common.proto`). Each engine client turns them into the values
below (`KvBatch`), so routing never reads a proto. The semantics follow the servicers' relay
(smg-grpc-servicer `kv_relay.py`, `load_record.py`):

- Every batch carries a sequence number per data-parallel rank (`dp_rank`); a subscriber keeps one
  cursor per rank and resumes with `start_sequence_number` = the last sequence it applied. A batch whose
  sequence is not above the rank's cursor is a duplicate (a replay overlap) and is dropped.
- A batch with `load.load_only` carries no events and repeats the rank's last sequence: it is a load
  record (a heartbeat, or a change without a KV event) and moves no cursor.
- A snapshot is `count` chunks with consecutive sequences; chunk 0 begins with a `CacheCleared`;
  applying them is a resync of the worker's index. `unknown_before` > 0 means the snapshot misses
  blocks stored before the relay's record: the worker stays partially known.
- Stored blocks chain: a `BlocksStored`'s first block's parent is `parent_hash` (an engine hash, None
  for a root), each next block's parent is the block before it. Engine hashes are opaque 64-bit values
  whose algorithm differs per engine; the index re-hashes token ids its own way and keeps the engine
  hash only to apply removals.
- A block may be stored more than once (vLLM keeps up to two physical copies); each removal removes one.
- Only `indexable` events (device tier, local, full-attention group) describe the engine's own prefix
  cache; the rest are dropped by the index.

The stream makes one of these per event and one `KvBatch` and `EngineLoad` per batch, tens of thousands
a second on a busy fleet, so those values are `NamedTuple`s: immutable like frozen dataclasses,
built several times faster (a 13-field frozen dataclass costs about 1 µs to build, the tuple 0.2 µs).
Compare them with values of their own type (a tuple compares equal to any tuple of the same items);
`_replace` makes a changed copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import UpstreamError


class BlocksStored(NamedTuple):
    #: Engine hash of each stored block, in chain order.
    hashes: tuple[int, ...]
    #: Token ids of each block (`len(token_ids[i])` is that block's size); empty when the store is not
    #: `indexable` (the engine clients leave out what nothing reads).
    token_ids: tuple[tuple[int, ...], ...]
    #: Engine hash of the first block's parent; None when the first block starts a prompt.
    parent_hash: int | None
    #: Cache namespace the engine hashed under; folded into the index's own hashes.
    lora_name: str = ""
    cache_salt: str = ""
    #: Device tier, local, full-attention: describes the engine's own prefix cache.
    indexable: bool = True


class BlocksRemoved(NamedTuple):
    hashes: tuple[int, ...]
    indexable: bool = True


@dataclass(frozen=True, slots=True)
class CacheCleared:
    pass


KvEvent = BlocksStored | BlocksRemoved | CacheCleared


@dataclass(frozen=True, slots=True)
class SnapshotChunk:
    index: int
    count: int
    #: Live blocks in the whole snapshot, physical copies counted.
    blocks: int
    #: Publisher sequences the relay never saw: > 0 leaves the worker partially known after the resync.
    unknown_before: int


class EngineLoad(NamedTuple):
    """The servicer's load record (`common.EngineLoad`); optional fields are None when not reported."""

    running_requests: int
    waiting_requests: int
    #: Prompt tokens of waiting requests not served from cache; None when the servicer cannot tell.
    waiting_uncached_tokens: int | None
    #: KV-cache utilisation in [0, 1].
    token_usage: float
    #: Non-evictable KV occupancy in [0, 1]; None when not reported.
    active_token_usage: float | None
    gen_throughput: float
    #: The engine's admission window; 0 when unknown.
    max_running_requests: int
    age_ms: int
    #: Monotonic per stream.
    sample: int
    load_only: bool
    #: Milliseconds since the engine last produced output while requests were in flight; None while idle.
    engine_silence_ms: int | None = None
    engine_reports_steps: bool | None = None
    prefill_pending_tokens: int | None = None


class KvBatch(NamedTuple):
    sequence: int
    timestamp: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None
    snapshot: SnapshotChunk | None = None
    load: EngineLoad | None = None


class KvStreamLost(Exception):
    """The relay could not keep the stream whole (gRPC `DATA_LOSS`, or `OUT_OF_RANGE` for a cursor it
    cannot resume from): the subscriber clears the worker's index and resubscribes from sequence 0."""


class KvEventsUnavailable(UpstreamError):
    """The engine's wire has `SubscribeKvEvents` but this engine publishes nothing (gRPC `UNIMPLEMENTED`:
    started without a KV-event publisher). Not recoverable by resubscribing at once; the worker routes
    without an index, and a later subscription may find the publisher on after a restart."""


def _total(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def combine_loads(loads: Sequence[EngineLoad]) -> EngineLoad:
    """One worker's load from its data-parallel ranks' records: counts, rates and windows summed (a
    window is 0, unknown, when any rank's is), KV usage averaged, the silence the longest, the age the
    oldest. An optional figure some rank leaves unset stays unset in the total where a partial sum would
    mislead (queued token-work, active usage); pending prefill sums what the ranks report."""
    if len(loads) == 1:
        return loads[0]
    if not loads:
        raise ValueError("no load records to combine")
    n = len(loads)
    uncached = [load.waiting_uncached_tokens for load in loads]
    active = [load.active_token_usage for load in loads]
    steps = {load.engine_reports_steps for load in loads}
    silences = [load.engine_silence_ms for load in loads if load.engine_silence_ms is not None]
    windows = [load.max_running_requests for load in loads]
    return EngineLoad(
        running_requests=sum(load.running_requests for load in loads),
        waiting_requests=sum(load.waiting_requests for load in loads),
        waiting_uncached_tokens=None if None in uncached else _total(uncached),
        token_usage=sum(load.token_usage for load in loads) / n,
        active_token_usage=None if None in active else sum(a for a in active if a is not None) / n,
        gen_throughput=sum(load.gen_throughput for load in loads),
        max_running_requests=0 if 0 in windows else sum(windows),
        age_ms=max(load.age_ms for load in loads),
        sample=max(load.sample for load in loads),
        load_only=all(load.load_only for load in loads),
        engine_silence_ms=max(silences) if silences else None,
        engine_reports_steps=steps.pop() if len(steps) == 1 else (False if False in steps else None),
        prefill_pending_tokens=_total([load.prefill_pending_tokens for load in loads]),
    )
