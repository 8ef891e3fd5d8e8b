"""A scripted `SubscribeKvEvents` publisher: a real grpc.aio SGLang scheduler server on loopback whose KV
event streams a test drives batch by batch.

Each subscription the gateway opens is recorded (`Subscription`: the start sequence and the load-records
flag it asked with) and waits for the test: `send` a batch, `end` the stream, or `fail` it with a gRPC
status (DATA_LOSS, OUT_OF_RANGE, ...). `await publisher.subscription(n)` waits for the n-th. `GetLoads`
answers `publisher.loads_answer` and counts its calls; with `publisher.unimplemented` set, both RPCs
answer UNIMPLEMENTED (an engine started without a publisher). The `*_batch` helpers build the messages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sg_grpc

MODEL = "kv-model"
BLOCK = 4


@dataclass
class _End:
    code: grpc.StatusCode | None = None
    details: str = ""


@dataclass(eq=False)
class Subscription:
    """One `SubscribeKvEvents` call, held open until the test ends it."""

    start: int
    load_records_first: bool
    queue: asyncio.Queue[pb.KvEventBatch | _End] = field(default_factory=asyncio.Queue)
    #: Set once the call is over, however it ended (the client cancelled it, or the test ended it).
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def send(self, *batches: pb.KvEventBatch) -> None:
        for batch in batches:
            self.queue.put_nowait(batch)

    def end(self) -> None:
        """End the stream cleanly (status OK), as a server going away politely does."""
        self.queue.put_nowait(_End())

    def fail(self, code: grpc.StatusCode, details: str = "scripted failure") -> None:
        self.queue.put_nowait(_End(code, details))


class KvPublisher(sg_grpc.SglangSchedulerServicer):
    def __init__(self) -> None:
        self.subscriptions: list[Subscription] = []
        self._subscribed = asyncio.Condition()
        self.loads_answer = sg.GetLoadsResponse(
            loads=[
                sg.SchedulerLoad(
                    num_running_reqs=4, num_waiting_reqs=2, token_usage=0.5, max_running_requests=8
                )
            ]
        )
        self.loads_calls = 0
        self._polled = asyncio.Condition()
        #: Answer UNIMPLEMENTED to SubscribeKvEvents and GetLoads.
        self.unimplemented = False
        #: Refuse a non-zero start with OUT_OF_RANGE, as the Python relay does.
        self.refuse_resume = False
        self.url = ""

    async def subscription(self, number: int, timeout: float = 10.0) -> Subscription:
        """The `number`-th subscription (1-based), once it was opened."""
        async with asyncio.timeout(timeout), self._subscribed:
            await self._subscribed.wait_for(lambda: len(self.subscriptions) >= number)
        return self.subscriptions[number - 1]

    async def polled(self, calls: int, timeout: float = 10.0) -> None:
        """Wait until GetLoads was called `calls` times in all."""
        async with asyncio.timeout(timeout), self._polled:
            await self._polled.wait_for(lambda: self.loads_calls >= calls)

    async def HealthCheck(self, request: Any, context: Any) -> sg.HealthCheckResponse:
        return sg.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(self, request: Any, context: Any) -> sg.GetModelInfoResponse:
        return sg.GetModelInfoResponse(
            served_model_name=MODEL, model_path=MODEL, max_context_length=4096, vocab_size=1000
        )

    async def GetLoads(self, request: Any, context: Any) -> sg.GetLoadsResponse:
        async with self._polled:
            self.loads_calls += 1
            self._polled.notify_all()
        if self.unimplemented:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no loads here")
        return self.loads_answer

    async def SubscribeKvEvents(
        self, request: pb.SubscribeKvEventsRequest, context: Any
    ) -> AsyncIterator[pb.KvEventBatch]:
        sub = Subscription(request.start_sequence_number, request.load_records_before_first_batch)
        async with self._subscribed:
            self.subscriptions.append(sub)
            self._subscribed.notify_all()
        try:
            if self.unimplemented:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV cache events not enabled")
            if self.refuse_resume and sub.start:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, "resubscribe with zero and rebuild")
            await context.send_initial_metadata(())
            while True:
                item = await sub.queue.get()
                if isinstance(item, _End):
                    if item.code is not None:
                        await context.abort(item.code, item.details)
                    return
                yield item
        finally:
            sub.closed.set()


@contextlib.asynccontextmanager
async def running_publisher() -> AsyncIterator[KvPublisher]:
    publisher = KvPublisher()
    server = grpc.aio.server()
    sg_grpc.add_SglangSchedulerServicer_to_server(publisher, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    publisher.url = f"grpc://127.0.0.1:{port}"
    try:
        yield publisher
    finally:
        await server.stop(grace=None)


def tokens(prompt: Sequence[int], block: int) -> list[int]:
    return list(prompt[block * BLOCK : (block + 1) * BLOCK])


def engine_hash(prompt: Sequence[int], blocks: int, salt: int = 0) -> int:
    """A stand-in for an engine's hash of the first `blocks` blocks of `prompt` (any stable value does)."""
    return hash((salt, tuple(prompt[: blocks * BLOCK]))) & 0x7FFF_FFFF_FFFF_FFFF


def stored(prompt: Sequence[int], start: int, end: int) -> pb.KvCacheEvent:
    """The engine stored blocks [start, end) of `prompt`, chained from block start-1."""
    message = pb.KvBlocksStored(
        blocks=[
            pb.KvBlock(block_hash=engine_hash(prompt, i + 1), token_ids=tokens(prompt, i), block_size=BLOCK)
            for i in range(start, end)
        ],
        tier=pb.KV_CACHE_TIER_DEVICE,
        locality=pb.KV_CACHE_LOCALITY_LOCAL,
    )
    if start:
        message.parent_block_hash = engine_hash(prompt, start)
    return pb.KvCacheEvent(stored=message)


def removed(prompt: Sequence[int], *blocks: int) -> pb.KvCacheEvent:
    """The engine removed blocks (1-based counts of `prompt`'s leading blocks)."""
    return pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=[engine_hash(prompt, b) for b in blocks]))


def cleared() -> pb.KvCacheEvent:
    return pb.KvCacheEvent(cleared=pb.KvCacheCleared())


def load_record(
    *,
    running: int = 1,
    load_only: bool = False,
    silence_ms: int | None = None,
    pending: int | None = None,
    sample: int = 0,
) -> pb.EngineLoad:
    record = pb.EngineLoad(
        running_requests=running,
        waiting_requests=0,
        token_usage=0.25,
        max_running_requests=8,
        load_only=load_only,
    )
    record.sample = sample
    if silence_ms is not None:
        record.engine_silence_ms = silence_ms
    if pending is not None:
        record.prefill_pending_tokens = pending
    return record


def batch(
    sequence: int,
    events: Iterable[pb.KvCacheEvent] = (),
    *,
    rank: int | None = None,
    load: pb.EngineLoad | None = None,
    snapshot: pb.KvSnapshotChunk | None = None,
    timestamp: float = 0.0,
) -> pb.KvEventBatch:
    message = pb.KvEventBatch(sequence_number=sequence, events=list(events), timestamp=timestamp)
    if rank is not None:
        message.dp_rank = rank
    if load is not None:
        message.load.CopyFrom(load)
    if snapshot is not None:
        message.snapshot.CopyFrom(snapshot)
    return message


def heartbeat(sequence: int, *, rank: int | None = None, **record: Any) -> pb.KvEventBatch:
    """A load-only batch: the last sequence repeated, no events."""
    return batch(sequence, rank=rank, load=load_record(load_only=True, **record))


def snapshot_chunk(index: int, count: int, blocks: int, unknown_before: int = 0) -> pb.KvSnapshotChunk:
    return pb.KvSnapshotChunk(index=index, count=count, blocks=blocks, unknown_before=unknown_before)
