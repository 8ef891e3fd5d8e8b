"""The KV-event stream's protos as the gateway's values: which events feed a prefix index, the load
records, the GetLoads answers, and the stream's failures as errors."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2, tokenspeed_scheduler_pb2, vllm_engine_pb2

from harmony_gateway.engines import kv_wire
from harmony_gateway.engines.kv_events import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    EngineLoad,
    KvBatch,
    KvEventsUnavailable,
    KvStreamLost,
    SnapshotChunk,
    combine_loads,
)
from harmony_gateway.engines.mlx_grpc import MlxGrpcClient
from harmony_gateway.engines.sglang_grpc import SglangGrpcClient
from harmony_gateway.engines.tokenspeed_grpc import TokenSpeedGrpcClient
from harmony_gateway.engines.trtllm_grpc import TrtllmGrpcClient
from harmony_gateway.engines.vllm_grpc import VllmGrpcClient
from harmony_gateway.errors import UpstreamError, UpstreamUnavailable

TOKENS = [list(range(i * 4, i * 4 + 4)) for i in range(3)]


def stored(**fields: object) -> pb.KvBlocksStored:
    blocks = [pb.KvBlock(block_hash=-5 + i, token_ids=t, block_size=4) for i, t in enumerate(TOKENS)]
    return pb.KvBlocksStored(blocks=blocks, **fields)  # type: ignore[arg-type]


def convert(*events: pb.KvCacheEvent, groups: dict[int, bool] | None = None, **batch: object) -> KvBatch:
    message = pb.KvEventBatch(events=events, **batch)  # type: ignore[arg-type]
    return kv_wire.kv_batch(
        pb.KvEventBatch.FromString(message.SerializeToString()), {} if groups is None else groups
    )


def test_a_store_keeps_its_chain_tokens_and_namespace() -> None:
    batch = convert(
        pb.KvCacheEvent(stored=stored(parent_block_hash=-9, lora_name="adapter", cache_salt="t1")),
        pb.KvCacheEvent(stored=stored()),
        sequence_number=7,
        timestamp=12.5,
    )
    assert batch == KvBatch(
        7,
        12.5,
        (
            BlocksStored((-5, -4, -3), tuple(map(tuple, TOKENS)), -9, "adapter", "t1", True),
            BlocksStored((-5, -4, -3), tuple(map(tuple, TOKENS)), None, "", "", True),
        ),
    )
    assert type(batch.events[0]) is BlocksStored and batch.dp_rank is None and batch.load is None


@pytest.mark.parametrize(
    ("fields", "indexable"),
    [
        ({}, True),  # an older servicer: no tier, no locality
        ({"tier": pb.KV_CACHE_TIER_DEVICE, "locality": pb.KV_CACHE_LOCALITY_LOCAL}, True),
        ({"tier": pb.KV_CACHE_TIER_HOST}, False),
        ({"tier": pb.KV_CACHE_TIER_DISK}, False),
        ({"locality": pb.KV_CACHE_LOCALITY_REMOTE}, False),
        ({"kv_cache_spec_kind": "full_attention", "group_idx": 0}, True),
        ({"kv_cache_spec_kind": "mla_attention"}, True),
        ({"kv_cache_spec_kind": "sliding_window", "group_idx": 1}, False),
    ],
)
def test_only_the_engines_own_prefix_cache_is_indexable(fields: dict[str, object], indexable: bool) -> None:
    [event] = convert(pb.KvCacheEvent(stored=stored(**fields))).events
    assert isinstance(event, BlocksStored) and event.indexable is indexable
    assert event.hashes == (-5, -4, -3)
    assert event.token_ids == (tuple(map(tuple, TOKENS)) if indexable else ())  # nothing reads them then


def test_an_untiered_block_on_another_cache_level_is_not_indexable() -> None:
    message = stored()
    message.blocks[0].cache_level = 1  # host, in the field older servicers fill
    [event] = convert(pb.KvCacheEvent(stored=message)).events
    assert isinstance(event, BlocksStored) and not event.indexable
    removed = pb.KvBlocksRemoved(block_hashes=[1], cache_level=2)
    [event] = convert(pb.KvCacheEvent(removed=removed)).events
    assert event == BlocksRemoved((1,), False)


def test_removals_follow_the_groups_the_stores_named() -> None:
    groups: dict[int, bool] = {}
    convert(
        pb.KvCacheEvent(stored=stored(kv_cache_spec_kind="full_attention", group_idx=0)),
        pb.KvCacheEvent(stored=stored(kv_cache_spec_kind="sliding_window", group_idx=1)),
        groups=groups,
    )
    assert groups == {0: True, 1: False}
    batch = convert(
        pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=[1, 2], group_idx=1)),
        pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=[3], group_idx=0)),
        pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=[4], group_idx=7)),  # never named: main
        pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=[5], tier=pb.KV_CACHE_TIER_HOST)),
        pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=[6], locality=pb.KV_CACHE_LOCALITY_REMOTE)),
        pb.KvCacheEvent(stored=stored(group_idx=1)),  # a kind-less store of the sliding group
        pb.KvCacheEvent(cleared=pb.KvCacheCleared()),
        groups=groups,
    )
    assert [getattr(e, "indexable", None) for e in batch.events] == [
        False,
        True,
        True,
        False,
        False,
        False,
        None,
    ]
    assert batch.events[0] == BlocksRemoved((1, 2), False)
    assert batch.events[-1] == CacheCleared()


def test_snapshot_rank_and_load_record() -> None:
    load = pb.EngineLoad(
        running_requests=3,
        waiting_requests=1,
        token_usage=0.5,
        gen_throughput=120.0,
        max_running_requests=64,
        age_ms=4,
        sample=9,
        load_only=True,
    )
    batch = convert(
        sequence_number=4,
        dp_rank=0,
        snapshot=pb.KvSnapshotChunk(index=1, count=3, blocks=40, unknown_before=2),
        load=load,
    )
    assert batch.dp_rank == 0  # set to 0, not absent
    assert batch.snapshot == SnapshotChunk(1, 3, 40, 2)
    assert batch.load == EngineLoad(3, 1, None, 0.5, None, 120.0, 64, 4, 9, True, None, None, None)
    load.waiting_uncached_tokens = 0
    load.active_token_usage = 0.25
    load.engine_silence_ms = 0
    load.engine_reports_steps = False
    load.prefill_pending_tokens = 0
    record = convert(load=load).load
    assert record is not None
    assert (
        record.waiting_uncached_tokens,
        record.active_token_usage,
        record.engine_silence_ms,
        record.engine_reports_steps,
        record.prefill_pending_tokens,
    ) == (0, 0.25, 0, False, 0)


@pytest.mark.parametrize("pb_module", [sglang_scheduler_pb2, vllm_engine_pb2, tokenspeed_scheduler_pb2])
def test_a_load_poll_combines_the_ranks(pb_module: object) -> None:
    loads = pb_module.GetLoadsResponse(  # type: ignore[attr-defined]
        loads=[
            pb_module.SchedulerLoad(  # type: ignore[attr-defined]
                dp_rank=rank,
                num_running_reqs=2 + rank,
                num_waiting_reqs=rank,
                num_waiting_uncached_tokens=100,
                token_usage=0.2 * (rank + 1),
                gen_throughput=50.0,
                max_running_requests=32,
            )
            for rank in range(2)
        ]
    )
    load = kv_wire.loads_answer(loads)
    assert (load.running_requests, load.waiting_requests, load.waiting_uncached_tokens) == (5, 1, 200)
    assert (load.token_usage, load.gen_throughput, load.max_running_requests) == (
        pytest.approx(0.3),
        100.0,
        64,
    )
    assert load.engine_silence_ms is None
    with pytest.raises(UpstreamError):
        kv_wire.loads_answer(pb_module.GetLoadsResponse())  # type: ignore[attr-defined]


def test_combined_records_keep_what_the_ranks_cannot_sum() -> None:
    a = EngineLoad(2, 1, 30, 0.5, 0.25, 10.0, 16, 3, 7, False, 900, True, 40)
    b = EngineLoad(1, 0, None, 0.1, None, 5.0, 0, 9, 2, True, None, True, None)
    load = combine_loads([a, b])
    assert load == EngineLoad(3, 1, None, pytest.approx(0.3), None, 15.0, 0, 9, 7, False, 900, True, 40)
    assert combine_loads([a]) is a


@pytest.mark.parametrize(
    ("code", "raised"),
    [
        (grpc.StatusCode.DATA_LOSS, KvStreamLost),
        (grpc.StatusCode.OUT_OF_RANGE, KvStreamLost),
        (grpc.StatusCode.UNIMPLEMENTED, KvEventsUnavailable),
        (grpc.StatusCode.UNAVAILABLE, UpstreamUnavailable),
        (grpc.StatusCode.INTERNAL, UpstreamError),
    ],
)
def test_stream_failures_become_errors(code: grpc.StatusCode, raised: type[Exception]) -> None:
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="why")
    with pytest.raises(raised) as info:
        with kv_wire.mapping_stream_errors("grpc://engine:1"):
            raise error
    assert info.value.__cause__ is error


async def test_what_each_wire_offers() -> None:
    offers = {
        cls.engine: (cls.capabilities.kv_events, cls.capabilities.loads)
        for cls in (SglangGrpcClient, VllmGrpcClient, TrtllmGrpcClient, TokenSpeedGrpcClient, MlxGrpcClient)
    }
    assert offers == {
        "sglang": (True, True),
        "vllm": (True, True),
        "tokenspeed": (True, True),
        "trtllm": (True, False),  # TRT-LLM answers no GetLoads
        "mlx": (False, False),
    }
    mlx = MlxGrpcClient("grpc://127.0.0.1:1")
    trtllm = TrtllmGrpcClient("grpc://127.0.0.1:1")
    try:
        with pytest.raises(UpstreamError):
            mlx.subscribe_kv_events(0)
        with pytest.raises(UpstreamError):
            await trtllm.loads(timeout=1.0)
    finally:
        await mlx.close()
        await trtllm.close()
