"""A KV-aware fleet end to end: cluster twins publish their KV events and loads over the real
`SubscribeKvEvents` stream, the gateway follows them, and `--policy kv_aware` routes on them.

Prompts go through `/generate` as token ids, so a test knows exactly which blocks a prompt needs and can
have a twin announce them as if another gateway had sent them there. Every wait is on the gateway's
state (its index, its load record, its veto), bounded, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import httpx
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from harmony_gateway.routing import Worker
from harmony_gateway.sim import RunningSim, SimConfig
from tests.conftest import MODEL
from tests.e2e._fleet import all_workers_up, next_request_id, served_by, sims
from tests.support.servers import RunningGateway, running_gateway
from tests.support.servers import test_settings as gateway_settings

FAST = {"health_interval": 0.2, "health_timeout": 0.5, "breaker_cooldown": 0.2}
PROMPT_TOKENS = 512


def prompt(seed: int) -> list[int]:
    """512 token ids no other seed's prompt shares a block with."""
    return [1000 + (seed * 7919 + i * 31) % 90_000 for i in range(PROMPT_TOKENS)]


async def until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.01)


def worker_of(gw: RunningGateway, engine: RunningSim) -> Worker:
    return next(w for w in gw.state.fleet.all_workers() if w.url == engine.url)


def holds(gw: RunningGateway, engine: RunningSim, ids: list[int]) -> int:
    """Tokens of `ids` the gateway's index of `engine` says it holds (-1 while the index is not
    complete)."""
    index = worker_of(gw, engine).kv_index
    if index is None or not index.complete:
        return -1
    return index.matched_tokens(ids)


async def generate(http: httpx.AsyncClient, ids: list[int], *, stream: bool = False) -> str:
    """Sends the prompt; returns the request id the engines saw it under."""
    rid = next_request_id("kvfleet")
    body = {"model": MODEL, "input_ids": ids, "sampling_params": {"max_new_tokens": 4}, "stream": stream}
    response = await http.post("/generate", json=body, headers={"x-request-id": rid})
    assert response.status_code == 200, response.text
    return rid


@contextlib.asynccontextmanager
async def fleet(
    *configs: SimConfig, **settings: Any
) -> AsyncIterator[tuple[list[RunningSim], RunningGateway, httpx.AsyncClient]]:
    async with sims(*configs) as engines:
        options = {**FAST, "policy": "kv_aware", **settings}
        config = gateway_settings(worker_urls=tuple(e.url for e in engines), **options)
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
            await all_workers_up(gw)
            for engine in engines:
                if engine.config.engine != "mlx":
                    await until(lambda e=engine: holds(gw, e, [1]) == 0, f"{engine.url} is followed")
            yield engines, gw, http


async def test_a_prefix_stored_on_one_worker_only_goes_there() -> None:
    """Worker B holds a prefix this gateway never sent anywhere (another replica did): B gets it."""
    async with fleet(SimConfig(), SimConfig()) as (engines, gw, http):
        ids = prompt(1)
        for holder in (0, 1):
            seed_ids = prompt(10 + holder)
            engines[holder].announce_prefix(seed_ids)
            await until(lambda h=holder, s=seed_ids: holds(gw, engines[h], s) == PROMPT_TOKENS, "announced")
            for _ in range(3):
                assert served_by(await generate(http, seed_ids), engines) == [holder]
        engines[1].announce_prefix(ids)
        await until(lambda: holds(gw, engines[1], ids) == PROMPT_TOKENS, "B's index holds the prefix")
        assert holds(gw, engines[0], ids) == 0
        rid = await generate(http, ids)
        assert served_by(rid, engines) == [1]


async def test_removed_and_cleared_blocks_move_the_prefix() -> None:
    async with fleet(SimConfig(), SimConfig()) as (engines, gw, http):
        a, b = engines
        ids = prompt(2)
        b.announce_prefix(ids)
        await until(lambda: holds(gw, b, ids) == PROMPT_TOKENS, "B holds it")
        assert served_by(await generate(http, ids), engines) == [1]

        # B evicts it and A now holds it: it follows to A.
        assert b.remove_prefix(ids) > 0
        a.announce_prefix(ids)
        await until(lambda: holds(gw, b, ids) == 0 and holds(gw, a, ids) == PROMPT_TOKENS, "moved to A")
        assert served_by(await generate(http, ids), engines) == [0]

        # A's cache is cleared and B holds it again: back to B.
        assert a.flush()
        b.announce_prefix(ids)
        await until(lambda: holds(gw, a, ids) == 0 and holds(gw, b, ids) == PROMPT_TOKENS, "back on B")
        assert served_by(await generate(http, ids), engines) == [1]


async def test_a_heavy_pushed_load_spills_the_prefix_to_an_idle_worker() -> None:
    """B holds the prefix, but its engine reports many running requests the gateway never sent (other
    replicas' work): the prompt goes to idle A."""
    slow = SimConfig(tokens_per_second=2.0, output_tokens=400)
    async with fleet(SimConfig(), slow) as (engines, gw, http):
        a, b = engines
        ids = prompt(3)
        b.announce_prefix(ids)
        await until(lambda: holds(gw, b, ids) == PROMPT_TOKENS, "B holds it")
        assert served_by(await generate(http, ids), engines) == [1]

        busy = 8
        channel = grpc.aio.insecure_channel(b.address)
        stub = pb_grpc.SglangSchedulerStub(channel)
        streams = [
            stub.Generate(
                pb.GenerateRequest(
                    request_id=f"elsewhere-{i}",
                    tokenized=pb.TokenizedInput(input_ids=prompt(100 + i)),
                    sampling_params=pb.SamplingParams(max_new_tokens=400, temperature=1.0, top_p=1.0, n=1),
                    stream=True,
                )
            )
            for i in range(busy)
        ]
        try:
            await until(lambda: b.active_requests == busy, "the other replicas' requests run on B")
            worker_b = worker_of(gw, b)
            await until(
                lambda: worker_b.engine_load is not None and worker_b.engine_load.running_requests >= busy,
                "B's pushed load shows them",
            )
            assert worker_b.in_flight == 0  # nothing of this gateway's own
            assert served_by(await generate(http, ids), engines) == [0]
        finally:
            for stream in streams:
                stream.cancel()
            await channel.close()


async def test_a_dropped_stream_resumes_at_the_last_sequence_applied() -> None:
    async with fleet(SimConfig(), SimConfig()) as (engines, gw, http):
        b = engines[1]
        first, second = prompt(4), prompt(5)
        b.announce_prefix(first)
        await until(lambda: holds(gw, b, first) == PROMPT_TOKENS, "B holds the first prefix")
        applied = b.kv_sequence
        assert applied is not None and b.kv_subscription_starts == [0]

        assert b.drop_kv_subscriptions() == 1
        await until(lambda: len(b.kv_subscription_starts) == 2 and b.kv_subscriptions == 1, "resubscribed")
        assert b.kv_subscription_starts[-1] == applied

        b.announce_prefix(second)
        await until(lambda: holds(gw, b, second) == PROMPT_TOKENS, "B holds the second prefix")
        # Resumed, not rebuilt: what the index knew before the drop is still there.
        assert holds(gw, b, first) == PROMPT_TOKENS
        assert served_by(await generate(http, second), engines) == [1]


async def test_a_snapshot_resyncs_a_gateway_that_joins_late() -> None:
    """The twin's history no longer reaches back to its first batch when the gateway subscribes: the
    relay serves a snapshot of its live blocks and the gateway's index is complete from it."""
    async with sims(SimConfig(), SimConfig(kv_history_batches=2)) as engines:
        b = engines[1]
        earlier = [prompt(20 + i) for i in range(4)]
        for ids in earlier:
            b.announce_prefix(ids)
        config = gateway_settings(worker_urls=tuple(e.url for e in engines), policy="kv_aware", **FAST)
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url, timeout=20) as http:
            await all_workers_up(gw)
            await until(lambda: all(holds(gw, b, ids) == PROMPT_TOKENS for ids in earlier), "resynced")
            assert b.kv_subscription_starts == [0]
            for ids in earlier:
                assert served_by(await generate(http, ids), engines) == [1]


async def test_a_silent_engine_is_avoided_until_it_speaks_again() -> None:
    async with fleet(SimConfig(), SimConfig(), engine_wedge_ms=300.0) as (engines, gw, http):
        a, b = engines
        ids = prompt(6)
        b.announce_prefix(ids)
        await until(lambda: holds(gw, b, ids) == PROMPT_TOKENS, "B holds it")
        worker_b = worker_of(gw, b)

        # The engine judges its silence on requests that stream every token, as the servicers do.
        b.wedge()
        stuck = asyncio.create_task(generate(http, ids, stream=True))
        try:
            await until(lambda: worker_b.in_flight == 1, "the request waits on B")
            await until(lambda: worker_b.wedged, "B's silence vetoes it")
            assert not worker_b.available()
            assert served_by(await generate(http, ids), engines) == [0]
        finally:
            b.unwedge()
        assert served_by(await stuck, engines) == [1]
        await until(lambda: not worker_b.wedged, "B speaks again")
        load = lambda: worker_b.engine_load  # noqa: E731
        await until(lambda: (record := load()) is not None and record.running_requests == 0, "B is idle")
        assert worker_b.available()
        # A served the prompt meanwhile and holds it too; once A evicts it, B has it alone again.
        assert a.remove_prefix(ids) > 0
        await until(lambda: holds(gw, a, ids) == 0, "A no longer holds it")
        assert served_by(await generate(http, ids), engines) == [1]


async def test_a_worker_without_kv_events_still_routes() -> None:
    """MLX has no SubscribeKvEvents: its worker is routed on the policy's own record beside a twin that
    publishes events."""
    async with fleet(SimConfig(engine="mlx"), SimConfig()) as (engines, gw, http):
        mlx, sglang = engines
        assert worker_of(gw, mlx).kv_index is None
        assert worker_of(gw, sglang).kv_index is not None
        served: set[int] = set()
        for seed in range(30, 34):
            ids = prompt(seed)
            (home,) = served_by(await generate(http, ids), engines)
            served.add(home)
            # The policy's record keeps a prompt on the worker it went to, events or not.
            if home == 1:
                await until(lambda i=ids: holds(gw, sglang, i) == PROMPT_TOKENS, "the twin stored it")
            assert served_by(await generate(http, ids), engines) == [home]
        assert served == {0, 1}
