"""The KV-event stream and the load poll on the wire: smg-grpc-proto's `common.KvEventBatch` and the
`GetLoads` answers turned into the gateway's values (`kv_events.py`), and the stream's failures into
its errors. Shared by every engine client whose wire carries `SubscribeKvEvents` (SGLang, vLLM, TRT-LLM,
TokenSpeed) or `GetLoads` (SGLang, vLLM, TokenSpeed); the messages are `common.proto`'s on all of them.

What feeds a prefix index (`indexable`) is decided here, once per event, as the servicers' relay
decides what it forwards: the device tier (or no tier: the field is absent from older servicers), a
local block (or no locality), and a main-attention cache group. A hybrid model publishes one group per
attention kind; a store names its group's kind, a removal only its group index, so the kinds learned
from the stores of one stream (`groups`) judge its removals. The conversion runs for every event of
every worker (about 20,000 a second on a busy fleet), so it reads each field once and builds nothing
it does not hand on.

| gRPC status of the stream       | raised                       | the subscriber                          |
|---------------------------------|------------------------------|-----------------------------------------|
| `DATA_LOSS`, `OUT_OF_RANGE`     | `KvStreamLost`               | clears the worker's index, resubscribes from 0 |
| `UNIMPLEMENTED`                 | `KvEventsUnavailable`        | the engine runs without a publisher: retries rarely |
| anything else                   | `errors.Upstream*` as usual  | resumes from its cursors after a back-off |
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, Protocol, TypeVar, cast

import grpc
from smg_grpc_proto.generated import common_pb2

from ..errors import UpstreamError
from .grpc_errors import translate_rpc_error
from .kv_events import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    EngineLoad,
    KvBatch,
    KvEvent,
    KvEventsUnavailable,
    KvStreamLost,
    SnapshotChunk,
    combine_loads,
)

#: Cache-group kinds whose blocks describe the prompt prefix an engine can reuse (full attention and
#: its variants); sliding-window and state-space groups hold only a tail.
MAIN_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})

_UNSET = common_pb2.KV_CACHE_TIER_UNSPECIFIED
_DEVICE = common_pb2.KV_CACHE_TIER_DEVICE
_LOCALITIES = (common_pb2.KV_CACHE_LOCALITY_UNSPECIFIED, common_pb2.KV_CACHE_LOCALITY_LOCAL)
_CLEARED = CacheCleared()
_LOST = frozenset({grpc.StatusCode.DATA_LOSS, grpc.StatusCode.OUT_OF_RANGE})

_Value = TypeVar("_Value", bound=tuple[Any, ...])


class _Build(Protocol):
    def __call__(self, cls: type[_Value], fields: tuple[Any, ...], /) -> _Value: ...


# The values are NamedTuples: built from a tuple of every field, in order, they skip the argument
# handling of their constructors (a fifth of what converting a small event costs).
_new = cast(_Build, tuple.__new__)

#: What `GetLoads` is asked for: the core figures only (the SGLang servicer sends every section otherwise).
LOAD_SECTIONS = ("core",)


def _main_group(message: Any, groups: dict[int, bool], kind: str) -> bool:
    """Whether the event's cache group is a main-attention one. A store that names its kind teaches
    the stream its group; an event without a kind follows its learned group, and an unknown group
    counts as main, as a single-group publisher's does."""
    if kind:
        main = kind in MAIN_ATTENTION_KINDS
        if message.HasField("group_idx"):
            groups[message.group_idx] = main
        return main
    if groups and message.HasField("group_idx"):
        return groups.get(message.group_idx, True)
    return True


def blocks_stored(stored: Any, groups: dict[int, bool]) -> BlocksStored:
    """A `KvBlocksStored` as `BlocksStored`. The token ids of a store that is not indexable are left
    out (`token_ids` is empty): nothing reads them, and they are most of what converting costs."""
    blocks = stored.blocks
    tier = stored.tier
    kind = stored.kv_cache_spec_kind
    indexable = (
        (tier == _DEVICE or (tier == _UNSET and not (blocks and blocks[0].cache_level)))
        and stored.locality in _LOCALITIES
        and (_main_group(stored, groups, kind) if kind or groups else True)
    )
    hashes = []
    token_ids = []
    if indexable:
        for block in blocks:
            hashes.append(block.block_hash)
            token_ids.append(tuple(block.token_ids[:]))  # slicing copies in C; iterating does not
    else:
        hashes = [block.block_hash for block in blocks]
    return _new(
        BlocksStored,
        (
            tuple(hashes),
            tuple(token_ids),
            stored.parent_block_hash if stored.HasField("parent_block_hash") else None,
            stored.lora_name,
            stored.cache_salt,
            indexable,
        ),
    )


def blocks_removed(removed: Any, groups: dict[int, bool]) -> BlocksRemoved:
    """A `KvBlocksRemoved` as `BlocksRemoved`."""
    tier = removed.tier
    indexable = (
        (tier == _DEVICE or (tier == _UNSET and not removed.cache_level))
        and removed.locality in _LOCALITIES
        and (_main_group(removed, groups, "") if groups else True)
    )
    return _new(BlocksRemoved, (tuple(removed.block_hashes[:]), indexable))


def engine_load(record: Any) -> EngineLoad:
    """A `common.EngineLoad` record as `EngineLoad` (absent optional fields as None)."""
    has = record.HasField
    return _new(
        EngineLoad,
        (
            record.running_requests,
            record.waiting_requests,
            record.waiting_uncached_tokens if has("waiting_uncached_tokens") else None,
            record.token_usage,
            record.active_token_usage if has("active_token_usage") else None,
            record.gen_throughput,
            record.max_running_requests,
            record.age_ms,
            record.sample,
            record.load_only,
            record.engine_silence_ms if has("engine_silence_ms") else None,
            record.engine_reports_steps if has("engine_reports_steps") else None,
            record.prefill_pending_tokens if has("prefill_pending_tokens") else None,
        ),
    )


def kv_batch(message: Any, groups: dict[int, bool]) -> KvBatch:
    """A `KvEventBatch` as `KvBatch`; `groups` is the stream's learned cache groups (see the module
    docstring), updated in place. A block's tier is read from `tier`, or from the older `cache_level`
    (0: the device) when no tier is set."""
    events: list[KvEvent] = []
    append = events.append
    for event in message.events:
        which = event.WhichOneof("data")
        if which == "stored":
            append(blocks_stored(event.stored, groups))
        elif which == "removed":
            append(blocks_removed(event.removed, groups))
        elif which == "cleared":
            append(_CLEARED)
    has = message.HasField
    snapshot = None
    if has("snapshot"):
        chunk = message.snapshot
        snapshot = SnapshotChunk(chunk.index, chunk.count, chunk.blocks, chunk.unknown_before)
    return _new(
        KvBatch,
        (
            message.sequence_number,
            message.timestamp,
            tuple(events),
            message.dp_rank if has("dp_rank") else None,
            snapshot,
            engine_load(message.load) if has("load") else None,
        ),
    )


def scheduler_load(load: Any) -> EngineLoad:
    """One rank's `SchedulerLoad` of a `GetLoads` answer (SGLang, vLLM, TokenSpeed: the same field
    names) as `EngineLoad`. The poll's queued token-work is a plain number on these wires, taken as
    reported; a poll knows nothing of the engine's silence."""
    has_active = "active_token_usage" in load.DESCRIPTOR.fields_by_name and load.HasField(
        "active_token_usage"
    )
    return EngineLoad(
        running_requests=max(0, load.num_running_reqs),
        waiting_requests=max(0, load.num_waiting_reqs),
        waiting_uncached_tokens=max(0, load.num_waiting_uncached_tokens),
        token_usage=load.token_usage,
        active_token_usage=load.active_token_usage if has_active else None,
        gen_throughput=load.gen_throughput,
        max_running_requests=max(0, load.max_running_requests),
        age_ms=0,
        sample=0,
        load_only=True,
    )


def loads_answer(answer: Any) -> EngineLoad:
    """A `GetLoadsResponse` as one `EngineLoad`, its data-parallel ranks combined (`combine_loads`).
    Raises UpstreamError for an answer without any rank."""
    ranks = [scheduler_load(load) for load in answer.loads]
    if not ranks:
        raise UpstreamError("the engine answered GetLoads without any load")
    return combine_loads(ranks)


def translate_stream_error(exc: grpc.aio.AioRpcError, url: str) -> UpstreamError | KvStreamLost:
    code = exc.code()
    if code in _LOST:
        return KvStreamLost(f"the KV-event stream of {url} cannot resume: {code.name}: {exc.details()}")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return KvEventsUnavailable(f"the engine at {url} publishes no KV events: {exc.details()}")
    return translate_rpc_error(exc, url)


@contextlib.contextmanager
def mapping_stream_errors(url: str) -> Iterator[None]:
    """A context in which a failed `SubscribeKvEvents` call raises `translate_stream_error` instead."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise translate_stream_error(exc, url) from exc


async def kv_event_stream(
    subscribe: Callable[..., Any], url: str, start_sequence: int, metadata: Any = None
) -> AsyncGenerator[KvBatch, None]:
    """Call `subscribe` (a stub's `SubscribeKvEvents`) from `start_sequence`, taking load records before
    the publisher's first batch, and yield its batches as `KvBatch`es until the server ends the stream.

    The call has no deadline: it lasts as long as the worker, and the channel's keepalive notices a
    peer that went away. Closing the iterator cancels the call."""
    request = common_pb2.SubscribeKvEventsRequest(
        start_sequence_number=start_sequence, load_records_before_first_batch=True
    )
    call = subscribe(request, metadata=metadata)
    groups: dict[int, bool] = {}
    try:
        with mapping_stream_errors(url):
            async for message in call:
                yield kv_batch(message, groups)
    finally:
        if not call.done():
            call.cancel()


__all__ = [
    "LOAD_SECTIONS",
    "MAIN_ATTENTION_KINDS",
    "blocks_removed",
    "blocks_stored",
    "engine_load",
    "kv_batch",
    "kv_event_stream",
    "loads_answer",
    "mapping_stream_errors",
    "scheduler_load",
    "translate_stream_error",
]
