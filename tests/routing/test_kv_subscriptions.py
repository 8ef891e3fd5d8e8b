"""Following a worker's engine over a real gRPC stream on loopback: subscriptions opened and closed with
the worker, resumption at the right sequence, duplicates, gaps, snapshots, restarts, lost streams, load
records, the wedge veto, load polls only while nothing is pushed, and the per-worker metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from harmony_gateway.app import create_app
from harmony_gateway.engines.mlx_grpc import MlxGrpcClient
from harmony_gateway.engines.registry import create_client
from harmony_gateway.routing import Worker, create_policy
from harmony_gateway.routing.fleet import Fleet
from harmony_gateway.routing.kv_index import KvIndex
from harmony_gateway.routing.kv_subscriptions import (
    FeedConfig,
    FeedState,
    KvEventMetrics,
    KvSubscriptions,
    WorkerFeed,
)
from harmony_gateway.tasks import TaskSupervisor
from tests.support.kv_publisher import (
    KvPublisher,
    batch,
    cleared,
    heartbeat,
    load_record,
    removed,
    running_publisher,
    snapshot_chunk,
    stored,
)
from tests.support.servers import test_settings

P = list(range(100, 132))  # 8 blocks of 4 tokens
Q = list(range(500, 532))
FAST = FeedConfig(backoff_initial=0.005, backoff_max=0.02, poll_interval=0.0, unavailable_retry=0.02)


class FakeClock:
    """The feeds' monotonic clock, moved only by the test."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Following:
    publisher: KvPublisher
    fleet: Fleet
    subs: KvSubscriptions
    tasks: TaskSupervisor
    worker: Worker
    feed: WorkerFeed
    registry: CollectorRegistry

    @property
    def index(self) -> KvIndex:
        assert self.feed.index is not None
        return self.feed.index

    def sample(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(
            name, {"worker": self.worker.id, "url": self.worker.url, **labels}
        )


@contextlib.asynccontextmanager
async def following(config: FeedConfig = FAST, clock: Any = None) -> AsyncIterator[Following]:
    async with running_publisher() as publisher:
        tasks = TaskSupervisor()
        fleet = Fleet(
            client_factory=lambda url, engine: create_client(url, engine),
            policy_factory=lambda model, role: create_policy("round_robin"),
        )
        registry = CollectorRegistry()
        extra = {"clock": clock} if clock is not None else {}
        subs = KvSubscriptions(tasks, config, KvEventMetrics(registry), **extra)
        subs.attach(fleet)
        try:
            worker = await fleet.admit(publisher.url, engine="sglang")
            yield Following(publisher, fleet, subs, tasks, worker, subs.feeds[worker.id], registry)
        finally:
            await tasks.aclose()
            await fleet.close()


async def test_a_worker_is_followed_from_joining_to_leaving() -> None:
    async with following() as f:
        sub = await f.publisher.subscription(1)
        assert (sub.start, sub.load_records_first) == (0, True)
        assert f.worker.kv_index is f.feed.index and not f.index.complete
        task = f.subs._tasks[f.worker.id]
        await f.fleet.remove(f.worker.id)
        await asyncio.wait_for(sub.closed.wait(), 10)
        await asyncio.wait([task], timeout=10)
        assert task.cancelled() and f.worker.kv_index is None and f.tasks.running == 0
        assert f.subs.feeds == {}


async def test_a_detected_engine_is_followed_once_its_protocol_is_known() -> None:
    async with running_publisher() as publisher:
        tasks = TaskSupervisor()
        fleet = Fleet(
            lambda url, engine: create_client(url, engine), lambda m, r: create_policy("round_robin")
        )
        subs = KvSubscriptions(tasks, FAST)
        subs.attach(fleet)
        try:
            worker = await fleet.admit(publisher.url)  # --engine auto: detected by the first probe
            assert worker.engine == "sglang" and worker.id in subs.feeds
            assert (await publisher.subscription(1)).start == 0
        finally:
            await tasks.aclose()
            await fleet.close()


async def test_batches_build_the_index_and_replays_are_dropped() -> None:
    async with following() as f:
        sub = await f.publisher.subscription(1)
        sub.send(batch(0, [stored(P, 0, 3)]))
        await f.feed.until(lambda: f.feed.cursors.get(0) == 0)
        assert f.index.complete and f.index.matched_tokens(P) == 12  # the publisher's first batch
        sub.send(batch(0, [stored(P, 3, 5)]))  # a replay of what was applied: dropped
        sub.send(batch(1, [stored(P, 3, 4)]), batch(2, [removed(P, 4)]), batch(3, [stored(Q, 0, 2)]))
        await f.feed.until(lambda: f.feed.cursors[0] == 3)
        assert f.feed.duplicates == 1
        assert (f.index.matched_tokens(P), f.index.matched_tokens(Q), f.index.complete) == (12, 8, True)


async def test_a_dropped_stream_resumes_from_the_last_sequence_applied() -> None:
    async with following() as f:
        sub = await f.publisher.subscription(1)
        sub.send(batch(0, [stored(P, 0, 1)]), batch(1, [stored(P, 1, 2)]), batch(2, [stored(P, 2, 3)]))
        await f.feed.until(lambda: f.feed.cursors.get(0) == 2)
        sub.end()
        resumed = await f.publisher.subscription(2)
        assert resumed.start == 2
        resumed.send(batch(2, [stored(Q, 0, 4)]), batch(3, [stored(P, 3, 4)]))  # the replay overlaps by one
        await f.feed.until(lambda: f.feed.cursors[0] == 3)
        assert f.feed.duplicates == 1 and f.index.complete
        assert (f.index.matched_tokens(P), f.index.matched_tokens(Q)) == (16, 0)
        resumed.fail(grpc.StatusCode.UNAVAILABLE)  # a broken stream resumes the same way
        assert (await f.publisher.subscription(3)).start == 3


async def test_a_stream_that_cannot_resume_rebuilds_from_zero() -> None:
    async with following() as f:
        sub = await f.publisher.subscription(1)
        sub.send(batch(0, [stored(P, 0, 3)]))
        await f.feed.until(lambda: f.feed.cursors.get(0) == 0)
        sub.fail(grpc.StatusCode.DATA_LOSS)
        fresh = await f.publisher.subscription(2)
        assert fresh.start == 0 and f.feed.cursors == {} and len(f.index) == 0 and not f.index.complete
        fresh.send(batch(40, [stored(P, 0, 2)]))  # live only from here: what came before is unknown
        await f.feed.until(lambda: f.feed.cursors.get(0) == 40)
        assert f.index.matched_tokens(P) == 8 and not f.index.complete
        # The Python relay keeps nothing between calls: a resume is OUT_OF_RANGE, then from 0 again.
        f.publisher.refuse_resume = True
        fresh.end()
        refused = await f.publisher.subscription(3)
        again = await f.publisher.subscription(4)
        assert (refused.start, again.start) == (40, 0) and len(f.index) == 0
        f.subs.refresh_metrics()
        assert f.sample("gateway_kv_resyncs_total", reason="stream_lost") == 2


async def test_a_gap_leaves_the_index_partial_until_a_snapshot_resyncs_it() -> None:
    async with following() as f:
        sub = await f.publisher.subscription(1)
        sub.send(batch(0, [stored(P, 0, 2)]), batch(1, [stored(P, 2, 3)]))
        await f.feed.until(lambda: f.feed.cursors.get(0) == 1)
        assert f.index.complete
        sub.send(batch(4, [stored(P, 3, 4)]))  # batches 2 and 3 never came
        resync = await f.publisher.subscription(2)
        await asyncio.wait_for(sub.closed.wait(), 10)  # the feed ended the first stream itself
        assert resync.start == 0 and f.feed.cursors[0] == 4 and not f.index.complete
        assert f.index.matched_tokens(P) == 16  # the gap batch's own events are real
        # From 0 the relay serves a snapshot of what the engine holds, live events after its last chunk.
        resync.send(
            batch(9, [cleared(), stored(P, 0, 2)], snapshot=snapshot_chunk(0, 2, 3)),
            batch(10, [stored(P, 2, 3)], snapshot=snapshot_chunk(1, 2, 3)),
        )
        await f.feed.until(lambda: f.index.complete)
        assert (f.index.matched_tokens(P), f.feed.cursors[0]) == (12, 10)
        resync.send(batch(11, [stored(P, 3, 5)]))
        await f.feed.until(lambda: f.feed.cursors[0] == 11)
        assert f.index.matched_tokens(P) == 20 and f.index.complete
        f.subs.refresh_metrics()
        assert f.sample("gateway_kv_resyncs_total", reason="gap") == 1
        assert f.sample("gateway_kv_resyncs_total", reason="snapshot") == 1


async def test_a_gap_the_relay_cannot_fill_is_asked_about_once() -> None:
    async with following() as f:
        sub = await f.publisher.subscription(1)
        sub.send(batch(0, [stored(P, 0, 1)]), batch(5, [stored(P, 1, 2)]))
        live = await f.publisher.subscription(2)
        live.send(batch(8, [stored(P, 2, 3)]), batch(9, [stored(P, 3, 4)]))  # live only: another gap
        await f.feed.until(lambda: f.feed.cursors.get(0) == 9)
        assert not f.index.complete and len(f.publisher.subscriptions) == 2
        live.send(batch(10, [cleared(), stored(Q, 0, 1)]))  # the engine's own clear: known again
        await f.feed.until(lambda: f.index.complete)
        assert (f.index.matched_tokens(P), f.index.matched_tokens(Q)) == (0, 4)


async def test_a_snapshot_cut_short_or_missing_old_blocks_keeps_the_rank_partial() -> None:
    async with following() as f:
        sub = await f.publisher.subscription(1)
        sub.send(batch(5, [cleared(), stored(P, 0, 1)], snapshot=snapshot_chunk(0, 2, 2)))
        await f.feed.until(lambda: f.feed.cursors.get(0) == 5)
        sub.end()  # before the second chunk
        again = await f.publisher.subscription(2)
        assert again.start == 0 and not f.index.complete
        again.send(batch(7, [cleared(), stored(Q, 0, 2)], snapshot=snapshot_chunk(0, 1, 2, unknown_before=3)))
        await f.feed.until(lambda: f.feed.cursors.get(0) == 7)
        assert not f.index.complete and f.index.matched_tokens(Q) == 8 and f.index.matched_tokens(P) == 0


async def test_a_publisher_that_started_over_clears_what_it_held() -> None:
    async with following() as f:
        sub = await f.publisher.subscription(1)
        sub.send(batch(0, [stored(P, 0, 3)]), batch(1, [stored(Q, 0, 2)]))
        await f.feed.until(lambda: f.feed.cursors.get(0) == 1)
        sub.end()
        resumed = await f.publisher.subscription(2)
        assert resumed.start == 1
        resumed.send(batch(0, [stored(Q, 0, 1)]))  # the engine restarted: its first batch again
        await f.feed.until(lambda: f.feed.cursors[0] == 0)
        assert (f.index.matched_tokens(P), f.index.matched_tokens(Q), f.index.complete) == (0, 4, True)
        f.subs.refresh_metrics()
        assert f.sample("gateway_kv_resyncs_total", reason="publisher_restart") == 1


async def test_load_records_land_on_the_worker() -> None:
    clock = FakeClock()
    async with following(clock=clock) as f:
        sub = await f.publisher.subscription(1)
        sub.send(heartbeat(0, running=3))  # numbered 0 before the publisher's first batch
        await f.feed.until(lambda: f.worker.engine_load is not None)
        assert f.worker.engine_load is not None and f.worker.engine_load.running_requests == 3
        assert f.worker.engine_load_at == clock.now and f.feed.cursors == {}
        clock.now += 1
        sub.send(batch(0, [stored(P, 0, 1)], load=load_record(running=5)))
        await f.feed.until(lambda: f.feed.cursors.get(0) == 0)
        assert f.worker.engine_load.running_requests == 5 and f.worker.engine_load_at == clock.now
        sub.send(heartbeat(0, rank=1, running=2))  # a second data-parallel rank: the worker's sum
        await f.feed.until(
            lambda: f.worker.engine_load is not None and f.worker.engine_load.running_requests == 7
        )
        assert f.feed.cursors == {0: 0}


async def test_a_silent_engine_is_vetoed_until_it_speaks() -> None:
    config = replace(FAST, wedge_ms=1000, prefill_rate=1000)
    async with following(config) as f:
        sub = await f.publisher.subscription(1)
        f.worker.healthy = True
        f.worker.in_flight = 1
        try:
            sub.send(heartbeat(0, silence_ms=5000))
            await f.feed.until(lambda: f.worker.wedged)
            assert not f.worker.available()
            sub.send(heartbeat(0, silence_ms=200))  # output again
            await f.feed.until(lambda: not f.worker.wedged)
            assert f.worker.available()
            sub.send(heartbeat(0, silence_ms=5000, pending=6000, sample=1))  # 6 s of prefill allowed for
            await f.feed.until(lambda: f.worker.engine_load is not None and f.worker.engine_load.sample == 1)
            assert not f.worker.wedged
            f.worker.in_flight = 0  # silence on others' requests alone vetoes nothing
            sub.send(heartbeat(0, silence_ms=9000, sample=2))
            await f.feed.until(lambda: f.worker.engine_load is not None and f.worker.engine_load.sample == 2)
            assert not f.worker.wedged
            f.worker.in_flight = 1
            sub.send(heartbeat(0, silence_ms=9000, sample=3))
            await f.feed.until(lambda: f.worker.wedged)
            f.subs.refresh_metrics()
            assert f.sample("gateway_worker_wedged") == 1
            sub.end()  # no records to judge it by any more: the health checks decide
            await f.feed.until(lambda: not f.worker.wedged)
        finally:
            f.worker.in_flight = 0


async def test_loads_are_polled_only_while_nothing_is_pushed() -> None:
    clock = FakeClock()
    async with following(replace(FAST, poll_interval=0.01), clock=clock) as f:
        sub = await f.publisher.subscription(1)
        await f.publisher.polled(1)  # nothing pushed yet
        await f.feed.until(lambda: f.worker.engine_load is not None)
        assert f.worker.engine_load is not None and f.worker.engine_load.running_requests == 4  # polled
        sub.send(heartbeat(0, running=1))
        await f.feed.until(
            lambda: f.worker.engine_load is not None and f.worker.engine_load.running_requests == 1
        )
        rounds = f.feed.poll_checks
        await f.feed.until(lambda: f.feed.poll_checks > rounds)  # a poll under way has finished
        calls, rounds = f.publisher.loads_calls, f.feed.poll_checks
        await f.feed.until(lambda: f.feed.poll_checks >= rounds + 3)
        assert f.publisher.loads_calls == calls  # records flow: no polls
        clock.now += 1.0  # and now none came within the interval
        await f.publisher.polled(calls + 1)
        await f.feed.until(
            lambda: f.worker.engine_load is not None and f.worker.engine_load.running_requests == 4
        )


async def test_a_stream_gone_quiet_is_dropped_and_resumed() -> None:
    clock = FakeClock()
    async with following(replace(FAST, poll_interval=0.01, stream_idle=5.0), clock=clock) as f:
        sub = await f.publisher.subscription(1)
        sub.send(batch(0, [stored(P, 0, 1)], load=load_record()), batch(1, [stored(P, 1, 2)]))
        await f.feed.until(lambda: f.feed.cursors.get(0) == 1)
        clock.now += 6.0  # heartbeats are due every few seconds: this peer is gone
        resumed = await f.publisher.subscription(2)
        await asyncio.wait_for(sub.closed.wait(), 10)
        assert resumed.start == 1 and f.index.complete  # resumed from its cursor, nothing lost


async def test_an_engine_without_a_publisher_is_asked_again_later() -> None:
    async with running_publisher() as publisher:
        publisher.unimplemented = True
        tasks = TaskSupervisor()
        fleet = Fleet(
            lambda url, engine: create_client(url, engine), lambda m, r: create_policy("round_robin")
        )
        subs = KvSubscriptions(tasks, replace(FAST, poll_interval=0.01))
        subs.attach(fleet)
        try:
            worker = await fleet.admit(publisher.url, engine="sglang")
            feed = subs.feeds[worker.id]
            await feed.until(lambda: feed.state is FeedState.UNAVAILABLE)
            assert worker.kv_index is None
            await publisher.polled(1)  # loads are still asked for (and refused here)
            publisher.unimplemented = False
            later = await publisher.subscription(len(publisher.subscriptions) + 1)
            later.send(batch(0, [stored(P, 0, 1)]))
            await feed.until(lambda: worker.kv_index is not None)
            assert feed.state is FeedState.STREAMING and worker.kv_index is feed.index
        finally:
            await tasks.aclose()
            await fleet.close()


async def test_per_worker_metrics_and_their_removal() -> None:
    async with following() as f:
        sub = await f.publisher.subscription(1)
        sub.send(batch(0, [stored(P, 0, 3), removed(P, 3)]), batch(1, [stored(Q, 0, 1)]))
        await f.feed.until(lambda: f.feed.cursors.get(0) == 1)
        f.subs.refresh_metrics()
        assert f.sample("gateway_kv_events_total") == 3
        assert f.sample("gateway_kv_index_blocks") == 3
        assert f.sample("gateway_kv_index_complete") == 1
        assert f.sample("gateway_kv_subscription_state", state="streaming") == 1
        assert f.sample("gateway_kv_subscription_state", state="backoff") == 0
        sub.send(batch(7, []))  # a gap
        await f.publisher.subscription(2)
        await f.fleet.remove(f.worker.id)
        for name in ("gateway_kv_events_total", "gateway_kv_index_blocks", "gateway_worker_wedged"):
            assert f.sample(name) is None
        assert f.sample("gateway_kv_resyncs_total", reason="gap") is None
        assert f.sample("gateway_kv_subscription_state", state="streaming") is None


async def test_a_worker_whose_engine_offers_neither_is_not_followed() -> None:
    subs = KvSubscriptions(TaskSupervisor())
    mlx = MlxGrpcClient("grpc://127.0.0.1:1")
    try:
        subs.start(Worker(url=mlx.url, client=mlx))
        assert subs.feeds == {}
        off = KvSubscriptions(TaskSupervisor(), FeedConfig(kv_events=False, poll_interval=0))
        sglang = create_client("grpc://127.0.0.1:1", "sglang")
        off.start(Worker(url="grpc://127.0.0.1:1", client=sglang))
        assert off.feeds == {}
        await sglang.close()
    finally:
        await mlx.close()


async def test_the_app_follows_its_workers_until_shutdown() -> None:
    async with running_publisher() as publisher:
        app = create_app(test_settings(worker_urls=(publisher.url,), engine="sglang"))
        async with app.router.lifespan_context(app):
            gateway = app.state.gateway
            sub = await publisher.subscription(1)
            [worker] = gateway.fleet.all_workers()
            feed = gateway.kv_subscriptions.feeds[worker.id]
            sub.send(batch(0, [stored(P, 0, 2)], load=load_record(running=2)))
            await feed.until(lambda: worker.engine_load is not None)
            assert worker.kv_index.matched_tokens(P) == 8 and worker.kv_index.complete
            metrics = (await httpx_get(app, "/metrics")).text
            assert f'gateway_kv_index_blocks{{url="{publisher.url}",worker="{worker.id}"}} 2.0' in metrics
        await asyncio.wait_for(sub.closed.wait(), 10)
        assert gateway.tasks.running == 0


async def httpx_get(app: Any, path: str) -> Any:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        return await http.get(path)


def test_feed_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        FeedConfig(max_blocks=0)
    with pytest.raises(ValueError):
        FeedConfig(wedge_ms=-1)
    with pytest.raises(ValueError):
        FeedConfig(backoff_initial=2, backoff_max=1)
