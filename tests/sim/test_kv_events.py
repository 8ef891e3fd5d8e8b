"""`SubscribeKvEvents` of the cluster twin over real grpc.aio stubs: stores in each engine's own hashes,
eviction, resume, snapshots, load records, and the test controls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg

from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from harmony_gateway.sim.kv_cache import engine_hashes

from ._helpers import render, user
from ._kv import Feed, generate, kinds, removed_hashes, stored_blocks, stub

ENGINES = ["sglang", "vllm", "trtllm", "tokenspeed"]
STYLE = {"sglang": "sglang", "tokenspeed": "sglang", "vllm": "vllm", "trtllm": "trtllm"}
PROMPT = render(user("Tell me about the long river that runs " * 12))


@contextlib.asynccontextmanager
async def twin(**config: object) -> AsyncIterator[tuple[RunningSim, grpc.aio.Channel]]:
    async with (
        await start_sim_engine(SimConfig(**config)) as sim,  # type: ignore[arg-type]
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        yield sim, channel


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_generated_prompt_is_stored_in_the_engines_own_hashes(engine: str) -> None:
    async with twin(engine=engine) as (sim, channel):
        feed = Feed(sim, channel)
        result = await generate(sim, PROMPT)
        expected = (len(PROMPT) + result["completion_tokens"] - 1) // 16
        blocks: list[tuple[int, int | None, list[int]]] = []
        batches = []
        while len(blocks) < expected:
            batch = await feed.next_events()
            batches.append(batch)
            blocks += stored_blocks(batch)
        # SGLang's radix cache announces itself with a clear; vLLM and TRT-LLM start with a store.
        startup = kinds(batches[0]) == ["cleared"]
        assert startup == (engine in ("sglang", "tokenspeed"))
        assert [b.sequence_number for b in batches] == list(range(len(batches)))
        assert all(b.dp_rank == 0 and b.HasField("load") for b in batches)
        tokens = [t for _, _, ids in blocks for t in ids]
        assert len(blocks) == expected
        assert tokens[: len(PROMPT) // 16 * 16] == PROMPT[: len(PROMPT) // 16 * 16]
        hashes = [h for h, _, _ in blocks]
        assert hashes == engine_hashes(STYLE[engine], tokens, 16)  # type: ignore[arg-type]
        assert [p for _, p, _ in blocks] == [None, *hashes[:-1]]
        stored = next(e.stored for b in batches for e in b.events if e.HasField("stored"))
        assert stored.tier == common_pb2.KV_CACHE_TIER_DEVICE
        assert stored.locality == common_pb2.KV_CACHE_LOCALITY_LOCAL
        assert all(block.block_size == 16 for block in stored.blocks)
        assert stored.HasField("group_idx") == (engine == "vllm")
        assert sim.cache_state().block_hashes == set(hashes)
        feed.call.cancel()


async def test_a_repeated_prefix_reports_its_leading_full_blocks_cached() -> None:
    async with twin() as (sim, _):
        first = await generate(sim, PROMPT, "a")
        assert first["cached_tokens"] == 0
        again = await generate(sim, PROMPT, "b")
        assert again["cached_tokens"] == (len(PROMPT) - 1) // 16 * 16
        # Only the leading full blocks the prompts share count.
        branch = [*PROMPT[:40], *range(5000, 5100)]
        assert sim.cached_tokens(branch) == 32
        assert (await generate(sim, branch, "c"))["cached_tokens"] == 32
        assert sim.load().cache_hit_rate > 0


async def test_eviction_publishes_removed_and_keeps_within_capacity() -> None:
    first, second = list(range(1000, 1048)), list(range(2000, 2048))
    async with twin(kv_capacity_tokens=64) as (sim, channel):
        feed = Feed(sim, channel)
        assert kinds(await feed.next_events()) == ["cleared"]
        await generate(sim, first, "a", max_tokens=4)
        stored_first = [h for h, _, _ in stored_blocks(await feed.next_events())]
        assert len(stored_first) == 3 and sim.cache_state().physical_blocks == 3
        await generate(sim, second, "b", max_tokens=4)
        batch = await feed.next_events()
        # Room for the second prompt's 4 blocks: the first's 3 unused blocks go, leaves first.
        assert removed_hashes(batch) == stored_first[::-1]
        assert len(stored_blocks(batch)) == 3
        state = sim.cache_state()
        assert state.physical_blocks <= state.capacity_blocks == 4
        assert state.evicted_blocks == 3
        assert sim.cached_tokens(first) == 0 and sim.cached_tokens(second) == 32
        feed.call.cancel()


async def test_resume_replays_exactly_the_batches_after_the_cursor() -> None:
    async with twin() as (sim, channel):
        for index in range(3):
            await generate(sim, [*PROMPT, index], f"r{index}", max_tokens=20)
        last = sim.kv_sequence
        assert last is not None and last >= 4
        everything = Feed(sim, channel)
        full = [await everything.next_events() for _ in range(last + 1)]
        resumed = Feed(sim, channel, start_sequence_number=2)
        replay = [await resumed.next_events() for _ in range(last - 2)]
        assert [b.sequence_number for b in replay] == list(range(3, last + 1))
        assert [list(b.events) for b in replay] == [list(b.events) for b in full[3:]]
        # Then live, with no gap.
        sim.announce_prefix(list(range(7000, 7032)))
        assert (await resumed.next_events()).sequence_number == last + 1
        assert (await everything.next_events()).sequence_number == last + 1
        everything.call.cancel()
        resumed.call.cancel()


async def test_cursors_the_history_cannot_serve_are_out_of_range() -> None:
    async with twin(kv_history_batches=3) as (sim, channel):
        for index in range(6):  # batches 1..6 after the startup clear; the window keeps 4..6
            sim.announce_prefix(list(range(1000 * index + 1000, 1000 * index + 1032)))
        assert sim.kv_sequence == 6
        for cursor in (2, 7):
            assert (
                await Feed(sim, channel, start_sequence_number=cursor).error() == grpc.StatusCode.OUT_OF_RANGE
            )
        # The oldest cursor the window can continue from.
        inside = Feed(sim, channel, start_sequence_number=3)
        assert [(await inside.next_events()).sequence_number for _ in range(3)] == [4, 5, 6]
        inside.call.cancel()


async def check_snapshot(sim: RunningSim, feed: Feed) -> int:
    """Read a snapshot off `feed` and check it against the cache; returns the sequence it ends at."""
    state = sim.cache_state()
    last = sim.kv_sequence
    assert last is not None
    first = await feed.next()
    assert first.HasField("snapshot") and first.snapshot.index == 0
    count = first.snapshot.count
    chunks = [first] + [await feed.next() for _ in range(count - 1)]
    assert [c.sequence_number for c in chunks] == list(range(last - count + 1, last + 1))
    assert [c.snapshot.index for c in chunks] == list(range(count))
    assert kinds(first)[0] == "cleared" and "cleared" not in kinds(first)[1:]
    assert all(c.snapshot.blocks == state.physical_blocks and c.snapshot.unknown_before == 0 for c in chunks)
    assert all(e.event_id == 0 for c in chunks for e in c.events)
    seen: set[int] = set()
    for chunk in chunks:
        for block_hash, parent, _ in stored_blocks(chunk):
            assert parent is None or parent in seen  # parents before children
            seen.add(block_hash)
    assert seen == state.block_hashes
    return last


async def test_a_cursor_of_zero_after_the_history_rolled_gets_a_snapshot_then_live_events() -> None:
    async with twin(kv_history_batches=3) as (sim, channel):
        for index in range(3):
            await generate(sim, [*PROMPT, index], f"r{index}", max_tokens=20)
        feed = Feed(sim, channel)
        through = await check_snapshot(sim, feed)
        sim.announce_prefix(list(range(9000, 9032)))
        live = await feed.next_events()
        assert live.sequence_number == through + 1 and not live.HasField("snapshot")
        feed.call.cancel()


async def test_a_large_snapshot_comes_in_chunks() -> None:
    # Blocks of one token: 2,100 live blocks need two chunks of 2,048.
    async with twin(block_size=1, kv_history_batches=2) as (sim, channel):
        sim.announce_prefix(list(range(100_000, 102_100)))
        sim.announce_prefix([1, 2, 3])
        sim.announce_prefix([4, 5, 6])
        feed = Feed(sim, channel)
        first = await feed.next()
        assert first.snapshot.count == 2
        rest = await feed.next()
        assert rest.sequence_number == first.sequence_number + 1 == sim.kv_sequence
        assert len(stored_blocks(first)) + len(stored_blocks(rest)) == 2106
        feed.call.cancel()


async def test_heartbeats_flow_while_idle_and_repeat_the_last_sequence() -> None:
    async with twin(kv_heartbeat_s=0.03, kv_heartbeat_backoff_s=0.06) as (sim, channel):
        feed = Feed(sim, channel)
        first = await feed.next()
        assert kinds(first) == ["cleared"] and not first.load.load_only and first.load.sample == 1
        # The stream's first record carries the telemetry.
        assert first.load.HasField("max_total_num_tokens") and first.load.max_total_num_tokens == 1_000_000
        beats = [await feed.next() for _ in range(4)]
        assert all(b.load.load_only and not b.events and b.sequence_number == 0 for b in beats)
        assert [b.load.sample for b in beats] == [2, 3, 4, 5]
        assert all(b.load.HasField("cache_hit_rate") for b in beats)
        await generate(sim, PROMPT, max_tokens=4)
        batch = await feed.next_events()
        # An event batch carries the routing core only.
        assert batch.load.sample > 5 and not batch.load.HasField("max_total_num_tokens")
        assert batch.load.max_running_requests == 1024
        feed.call.cancel()


async def test_load_records_before_the_first_batch_only_when_asked() -> None:
    async with twin(engine="vllm", kv_heartbeat_s=0.02) as (sim, channel):
        asked = Feed(sim, channel, load_records_before_first_batch=True)
        record = await asked.next()
        assert record.load.load_only and record.sequence_number == 0 and record.load.sample == 1
        plain = Feed(sim, channel)
        await asyncio.sleep(0.1)  # time for heartbeats, had the stream sent any
        await generate(sim, PROMPT, max_tokens=4)
        first = await plain.next()
        assert not first.load.load_only and first.sequence_number == 0 and kinds(first) == ["stored"]
        assert (await asked.next_events()).sequence_number == 0
        asked.call.cancel()
        plain.call.cancel()


async def test_a_wedged_engine_reports_its_growing_silence() -> None:
    config = {"kv_heartbeat_s": 0.03, "kv_heartbeat_backoff_s": 0.03, "kv_load_tick_s": 0.01}
    async with twin(**config) as (sim, channel):
        feed = Feed(sim, channel)
        await feed.next()
        sim.wedge()
        call = asyncio.create_task(generate(sim, PROMPT, stream=True, max_tokens=8))
        silences: list[int] = []
        while not silences or silences[-1] < 150:
            batch = await feed.next()
            if batch.load.HasField("engine_silence_ms"):
                assert batch.load.running_requests == 1
                silences.append(batch.load.engine_silence_ms)
        assert silences == sorted(silences)
        assert not call.done()
        sim.unwedge()
        result = await asyncio.wait_for(call, 10)
        assert result["completion_tokens"] == 8
        # Idle again: no silence to report.
        assert sim.load().engine_silence_ms is None
        feed.call.cancel()


async def test_announce_remove_flush_and_drop_controls() -> None:
    async with twin() as (sim, channel):
        feed = Feed(sim, channel)
        await feed.next_events()  # the startup clear
        assert sim.announce_prefix(PROMPT) == len(PROMPT) // 16
        announced = stored_blocks(await feed.next_events())
        hashes = engine_hashes("sglang", PROMPT, 16)
        assert [h for h, _, _ in announced] == hashes
        # A request for the announced prompt is served from the cache.
        assert (await generate(sim, PROMPT, max_tokens=2))["cached_tokens"] == (len(PROMPT) - 1) // 16 * 16
        assert sim.remove_prefix(PROMPT, from_token=32) > 0
        batch = await feed.next_events()
        while not removed_hashes(batch):  # past its output block, if it filled one
            batch = await feed.next_events()
        removed = removed_hashes(batch)
        assert hashes[2] in removed and hashes[1] not in removed
        assert sim.cached_tokens(PROMPT) == 32
        assert sim.flush()
        assert kinds(await feed.next_events()) == ["cleared"]
        assert sim.cache_state().blocks == 0
        last = sim.kv_sequence
        assert sim.drop_kv_subscriptions() == 1
        assert await feed.error() == grpc.StatusCode.UNAVAILABLE
        resumed = Feed(sim, channel, start_sequence_number=last)
        sim.announce_prefix(PROMPT[:32])
        assert (await resumed.next_events()).sequence_number == last + 1  # type: ignore[operator]
        resumed.call.cancel()


async def test_flush_cache_rpc_refuses_while_requests_run() -> None:
    async with twin() as (sim, channel):
        scheduler = stub(sim, channel)
        sim.announce_prefix(PROMPT)
        sim.hold()
        call = asyncio.create_task(generate(sim, PROMPT, max_tokens=2))
        feed = Feed(sim, channel, load_records_before_first_batch=True)
        while (await feed.next()).load.running_requests == 0:
            pass
        refused = await scheduler.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0))
        assert not refused.success and sim.cache_state().blocks > 0
        sim.release_held()
        await asyncio.wait_for(call, 10)
        assert (await scheduler.FlushCache(common_pb2.FlushCacheRequest(timeout_s=1))).success
        assert sim.cache_state().blocks == 0
        feed.call.cancel()


async def test_a_publisher_restart_ends_streams_with_data_loss() -> None:
    async with twin() as (sim, channel):
        await generate(sim, PROMPT, max_tokens=4)
        feed = Feed(sim, channel)
        await feed.next_events()
        last = sim.kv_sequence
        sim.restart_kv_publisher()
        assert await feed.error() == grpc.StatusCode.DATA_LOSS
        assert sim.cache_state().blocks == 0
        # The old cursor belongs to the previous incarnation; from zero, the new one's startup clear.
        assert await Feed(sim, channel, start_sequence_number=last).error() == grpc.StatusCode.OUT_OF_RANGE
        again = Feed(sim, channel)
        first = await again.next_events()
        assert first.sequence_number == 0 and kinds(first) == ["cleared"]
        again.call.cancel()


async def test_vllm_stores_a_second_copy_that_the_snapshot_repeats() -> None:
    async with twin(engine="vllm", kv_history_batches=1) as (sim, channel):
        sim.hold()
        calls = [asyncio.create_task(generate(sim, PROMPT, f"r{i}", max_tokens=40)) for i in range(2)]
        feed = Feed(sim, channel, load_records_before_first_batch=True)
        while (await feed.next()).load.running_requests < 2:
            pass
        sim.release_held()
        await asyncio.gather(*calls)
        state = sim.cache_state()
        # Both requests computed the same output blocks: vLLM holds each twice.
        assert state.physical_blocks > state.blocks
        feed.call.cancel()
        snapshot = Feed(sim, channel)
        await check_snapshot(sim, snapshot)
        snapshot.call.cancel()


async def test_kv_events_off_answers_unimplemented() -> None:
    async with twin(kv_events=False) as (sim, channel):
        assert await Feed(sim, channel).error() == grpc.StatusCode.UNIMPLEMENTED
        assert sim.kv_sequence is None
        assert (await generate(sim, PROMPT, max_tokens=2))["completion_tokens"] == 2


async def test_get_loads_reads_the_same_figures() -> None:
    async with twin(max_running_requests=7, kv_capacity_tokens=4096) as (sim, channel):
        sim.announce_prefix(PROMPT)
        loads = await stub(sim, channel).GetLoads(sg.GetLoadsRequest())
        load = loads.loads[0]
        assert load.max_running_requests == 7 and load.max_total_num_tokens == 4096
        # Retained cache no request uses is not SGLang's usage.
        assert load.token_usage == 0 and load.num_waiting_uncached_tokens == 0
        info = await stub(sim, channel).GetServerInfo(sg.GetServerInfoRequest())
        assert info.server_args["page_size"] == 16 and info.max_total_num_tokens == 4096


@pytest.mark.parametrize(("history", "refilled"), [(10_000, True), (1_000, False)])
async def test_a_subscriber_that_falls_behind_is_refilled_or_told_data_loss(
    history: int, refilled: bool
) -> None:
    async with twin(kv_history_batches=history) as (sim, channel):
        feed = Feed(sim, channel)
        assert kinds(await feed.next_events()) == ["cleared"]
        # 5,000 batches in one turn: more than a stream may queue (4,096) before it reads again.
        for index in range(5000):
            sim.announce_prefix([index, *range(1, 16)])
        if not refilled:
            assert await feed.error() == grpc.StatusCode.DATA_LOSS
            return
        sequences = [(await feed.next_events()).sequence_number for _ in range(5000)]
        assert sequences == list(range(1, 5001))
        feed.call.cancel()
