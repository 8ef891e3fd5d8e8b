"""The cluster twin's timing model and admission window, over the SGLang wire. Relations between
durations, not absolute wall times: prefill follows the uncached prompt, decode slows with the batch,
requests past the window wait FIFO and their uncached tokens show on the load."""

from __future__ import annotations

import asyncio
import time

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sg_grpc

from harmony_gateway.sim import SimConfig, start_sim_engine

from ._kv import Feed, generate_request

LONG = list(range(10_000, 12_000))


async def first_token_and_total(
    stub: sg_grpc.SglangSchedulerStub, ids: list[int], rid: str, tokens: int
) -> tuple[float, float]:
    """Seconds to the first streamed chunk and to the end of the stream."""
    started = time.monotonic()
    first = 0.0
    async for response in stub.Generate(
        generate_request("sglang", ids, rid, stream=True, max_tokens=tokens), timeout=20
    ):
        if not first and response.HasField("chunk"):
            first = time.monotonic() - started
    return first, time.monotonic() - started


async def test_prefill_time_follows_the_uncached_prompt() -> None:
    # 2,000 uncached tokens at 0.05 ms each: 100 ms of prefill; repeated, all but the last block is cached.
    async with (
        await start_sim_engine(SimConfig(prefill_ms_per_token=0.05)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = sg_grpc.SglangSchedulerStub(channel)
        cold, _ = await first_token_and_total(stub, LONG, "cold", 2)
        warm, _ = await first_token_and_total(stub, LONG, "warm", 2)
        assert cold >= 0.09
        assert warm < cold / 2


async def test_decode_slows_as_the_running_batch_grows() -> None:
    # Alone: 1 + 5 x 1 = 6 ms a token; four at once: up to 1 + 5 x 4 = 21 ms a token.
    config = SimConfig(decode_ms_per_token=1.0, decode_ms_per_running=5.0)
    async with await start_sim_engine(config) as sim, grpc.aio.insecure_channel(sim.address) as channel:
        stub = sg_grpc.SglangSchedulerStub(channel)
        _, alone = await first_token_and_total(stub, [1, 2, 3], "alone", 24)
        together = await asyncio.gather(
            *(first_token_and_total(stub, [1, 2, 3, i], f"b{i}", 24) for i in range(4))
        )
        slowest = max(total for _, total in together)
        assert alone >= 23 * 0.006 * 0.9
        assert slowest > 2 * alone


async def test_requests_past_the_admission_window_wait_and_show_their_uncached_tokens() -> None:
    config = SimConfig(max_running_requests=1, kv_heartbeat_s=0.05)
    async with await start_sim_engine(config) as sim, grpc.aio.insecure_channel(sim.address) as channel:
        stub = sg_grpc.SglangSchedulerStub(channel)
        sim.announce_prefix(LONG[:1024])  # 64 blocks
        feed = Feed(sim, channel, load_records_before_first_batch=True)
        sim.hold()  # the first request, once admitted, holds its slot
        first = asyncio.create_task(first_token_and_total(stub, [7, 8, 9], "first", 2))
        record = (await feed.next()).load
        while record.running_requests < 1:
            record = (await feed.next()).load
        second = asyncio.create_task(first_token_and_total(stub, LONG, "second", 2))
        while record.waiting_requests < 1:
            record = (await feed.next()).load
        assert record.running_requests == 1 and record.max_running_requests == 1
        # The second prompt's first 1,024 tokens were cached when it arrived.
        assert record.waiting_uncached_tokens == len(LONG) - 1024
        assert record.prefill_pending_tokens == len(LONG)
        loads = (await stub.GetLoads(sg.GetLoadsRequest())).loads[0]
        assert (loads.num_running_reqs, loads.num_waiting_reqs) == (1, 1)
        assert loads.num_waiting_uncached_tokens == len(LONG) - 1024
        assert not second.done()
        sim.release_held()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert sim.load().waiting == 0 and sim.load().running == 0
        feed.call.cancel()


async def test_a_request_that_does_not_fit_the_kv_cache_waits_for_room() -> None:
    # 128 tokens of KV: a running request's 100-token prompt and output leave no room for another.
    config = SimConfig(kv_capacity_tokens=128, kv_heartbeat_s=0.05)
    async with await start_sim_engine(config) as sim, grpc.aio.insecure_channel(sim.address) as channel:
        stub = sg_grpc.SglangSchedulerStub(channel)
        sim.hold()
        feed = Feed(sim, channel, load_records_before_first_batch=True)
        first = asyncio.create_task(first_token_and_total(stub, LONG[:100], "first", 20))
        record = (await feed.next()).load
        while record.running_requests < 1:
            record = (await feed.next()).load
        second = asyncio.create_task(first_token_and_total(stub, LONG[200:300], "second", 20))
        while record.waiting_requests < 1:
            record = (await feed.next()).load
        assert record.running_requests == 1
        assert 0.9 < record.token_usage <= 1.0
        sim.release_held()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        state = sim.cache_state()
        assert state.physical_blocks <= state.capacity_blocks and state.evicted_blocks > 0
        feed.call.cancel()
