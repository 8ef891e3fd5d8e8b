"""Clients for the cluster-twin tests: one Generate per wire, and a KV-event feed read batch by batch."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sg_grpc
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as ts
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as ts_grpc
from smg_grpc_proto.generated import trtllm_service_pb2 as tr
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tr_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vl
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vl_grpc

from harmony_gateway.sim import RunningSim

from ._helpers import HARMONY_STOPS

STUBS: dict[str, Any] = {
    "sglang": sg_grpc.SglangSchedulerStub,
    "vllm": vl_grpc.VllmEngineStub,
    "trtllm": tr_grpc.TrtllmServiceStub,
    "tokenspeed": ts_grpc.TokenSpeedSchedulerStub,
}


def stub(sim: RunningSim, channel: grpc.aio.Channel) -> Any:
    return STUBS[sim.config.engine](channel)


def generate_request(
    engine: str, ids: Sequence[int], request_id: str, *, stream: bool, max_tokens: int
) -> Any:
    """A Generate request on `engine`'s wire whose output keeps its stop token."""
    if engine == "sglang":
        return sg.GenerateRequest(
            request_id=request_id,
            tokenized=sg.TokenizedInput(input_ids=list(ids)),
            sampling_params=sg.SamplingParams(max_new_tokens=max_tokens, stop_token_ids=HARMONY_STOPS),
            stream=stream,
        )
    if engine == "vllm":
        return vl.GenerateRequest(
            request_id=request_id,
            tokenized=vl.TokenizedInput(input_ids=list(ids)),
            sampling_params=vl.SamplingParams(max_tokens=max_tokens, stop_token_ids=HARMONY_STOPS),
            stream=stream,
        )
    if engine == "tokenspeed":
        return ts.GenerateRequest(
            request_id=request_id,
            tokenized=ts.TokenizedInput(input_ids=list(ids)),
            sampling_params=ts.SamplingParams(max_new_tokens=max_tokens, stop_token_ids=HARMONY_STOPS),
            stream=stream,
        )
    return tr.GenerateRequest(
        request_id=request_id,
        tokenized=tr.TokenizedInput(input_token_ids=list(ids)),
        max_tokens=max_tokens,
        streaming=stream,
        stop_token_ids=HARMONY_STOPS,
        include_stop_token_in_output=True,
    )


async def generate(
    sim: RunningSim, ids: Sequence[int], request_id: str = "r", *, stream: bool = False, max_tokens: int = 512
) -> dict[str, Any]:
    """One Generate call; the last Complete's `completion_tokens` and `cached_tokens`, and the
    responses."""
    async with grpc.aio.insecure_channel(sim.address) as channel:
        call = stub(sim, channel).Generate(
            generate_request(sim.config.engine, ids, request_id, stream=stream, max_tokens=max_tokens),
            timeout=20,
        )
        responses = [response async for response in call]
    complete = responses[-1].complete
    counted = complete.completion_tokens
    if sim.config.engine == "vllm" and stream:
        # vLLM streams count per chunk: the total is the sum of the chunks' counts.
        counted = sum(r.chunk.completion_tokens for r in responses if r.HasField("chunk"))
    first = next((r for r in responses), None)
    cached = complete.cached_tokens
    if first is not None and first.HasField("chunk"):
        cached = first.chunk.cached_tokens
    return {"completion_tokens": counted, "cached_tokens": cached, "responses": responses}


class Feed:
    """One `SubscribeKvEvents` call, read a batch at a time with a bound on every wait."""

    def __init__(self, sim: RunningSim, channel: grpc.aio.Channel, **request: Any) -> None:
        self.call = stub(sim, channel).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(**request))
        self._batches = self.call.__aiter__()

    async def next(self, timeout: float = 5.0) -> common_pb2.KvEventBatch:
        async with asyncio.timeout(timeout):
            batch: common_pb2.KvEventBatch = await self._batches.__anext__()
            return batch

    async def next_events(self, timeout: float = 5.0) -> common_pb2.KvEventBatch:
        """The next batch that is not `load_only`."""
        while True:
            batch = await self.next(timeout)
            if not batch.load.load_only:
                return batch

    async def error(self, timeout: float = 5.0) -> grpc.StatusCode:
        """Read until the stream ends in an error; its status code."""
        try:
            while True:
                await self.next(timeout)
        except grpc.aio.AioRpcError as exc:
            return exc.code()


def stored_blocks(batch: common_pb2.KvEventBatch) -> list[tuple[int, int | None, list[int]]]:
    """`(hash, parent hash, token ids)` of every stored block of a batch, parents as the events chain
    them."""
    out: list[tuple[int, int | None, list[int]]] = []
    for event in batch.events:
        if event.HasField("stored"):
            stored = event.stored
            parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
            for block in stored.blocks:
                out.append((block.block_hash, parent, list(block.token_ids)))
                parent = block.block_hash
    return out


def removed_hashes(batch: common_pb2.KvEventBatch) -> list[int]:
    return [h for event in batch.events if event.HasField("removed") for h in event.removed.block_hashes]


def kinds(batch: common_pb2.KvEventBatch) -> list[str]:
    return [str(event.WhichOneof("data")) for event in batch.events]
