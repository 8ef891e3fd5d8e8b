"""What each engine pushes about itself, followed per worker: its KV events into its prefix index
(`Worker.kv_index`), its load records onto the worker (`Worker.engine_load`), and its silence into the
wedge veto (`Worker.wedged`); polls of its load while nothing is pushed.

`KvSubscriptions` opens one `WorkerFeed` per worker whose engine offers `SubscribeKvEvents` or `GetLoads`
when the worker joins the fleet (after the probe that learnt its engine) and ends it when the worker
leaves; each feed runs as one task of the app's `TaskSupervisor`. Under `serve --workers N` every
process follows every worker itself.

The stream (see `engines/kv_events.py` for what the values mean):

1. The feed subscribes with `load_records_before_first_batch` and keeps one cursor per data-parallel
   rank. A rank's first batch sets its cursor; a batch at the cursor or below it is a duplicate of a
   replay and is dropped, unless it shows the publisher started over (below the cursor on a fresh
   connection, a sequence of 0 or 1, a cache clear, or far below): the rank's blocks are then cleared
   and the batch applied. A load-only batch (a heartbeat) moves no cursor.
2. After a drop the feed resumes from the lowest rank's cursor (the servicers replay that rank's
   publisher; other ranks drop what they already hold), after a back-off that doubles from
   `backoff_initial` to `backoff_max` with jitter (0.5 to 1 of the delay) and starts over once a
   stream delivered anything.
3. `KvStreamLost` (the relay's `DATA_LOSS`, or `OUT_OF_RANGE` for a cursor it cannot resume from: the
   Python relay keeps nothing between calls) clears the worker's index and every cursor, and the feed
   resubscribes from 0 at once.
4. A gap (a sequence past the cursor + 1) leaves the rank partially known: its batch is applied (its
   events are real), and the feed asks for a resync once by resubscribing from 0 with its index and
   cursors kept. The relays never leave a gap on a stream they consider whole (the Python relay fills
   one from the publisher's replay or ends the stream with `DATA_LOSS`), so the relay's own record
   is what lacks the batches, and a resume from the cursor would be answered from that same record.
   From 0, a relay that kept the publisher's history from its first batch replays it (a sequence
   below the cursor on a fresh connection: the rank starts over from its first batch, known again);
   one whose history has rolled serves a snapshot; a relay with neither (the Python relay is live
   only from 0) continues live, and the rank stays partially known until the engine clears its cache.
5. A snapshot's chunks are applied as a resync: chunk 0 clears the rank, every chunk moves its cursor
   to its sequence, and after the last the rank is known unless `unknown_before` says the relay missed
   older blocks. A stream that ends mid-snapshot leaves the rank to be resynced from 0 again.
6. A rank is known (and the index `complete` once every rank is) from its publisher's first batch
   (sequence 0), a cache clear, or a whole snapshot, until a gap.

Loads: every load record (on every batch, and as heartbeats) becomes `worker.engine_load` (the ranks'
records combined) and `engine_load_at`. A worker whose engine answers `GetLoads` is polled every
`poll_interval` seconds while no record was pushed within that interval, and not while records flow.

The wedge veto: a pushed record whose `engine_silence_ms` is past `wedge_ms` plus the time its pending
prefill may take (`prefill_pending_tokens` at `prefill_rate` tokens a second: a configured bound on how
slowly a healthy engine prefills, not a measured rate) while the gateway has requests in flight on the
worker sets `worker.wedged`, which keeps traffic off it; a later record whose silence is within the
bound, or unset (the engine produced output, or holds nothing), clears it. The veto lasts only while
records arrive: a feed whose stream ends clears it, leaving the worker to its health checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

import anyio
from prometheus_client import CollectorRegistry

from ..engines.kv_events import (
    CacheCleared,
    EngineLoad,
    KvBatch,
    KvEventsUnavailable,
    KvStreamLost,
    combine_loads,
)
from ..errors import UpstreamError
from ..observability.metrics import MetricSet, counter, gauge
from ..tasks import SupervisorClosed, TaskSupervisor
from .fleet import Fleet
from .kv_index import DEFAULT_MAX_BLOCKS, KvIndex
from .workers import Worker

log = logging.getLogger(__name__)

#: A sequence this far below a rank's cursor is a publisher that started over, not a late duplicate
#: (replays start where the subscriber asked, just above its cursor).
RESTART_WINDOW = 1024


class FeedState(enum.StrEnum):
    """Where a worker's subscription stands (the `gateway_kv_subscription_state` gauge)."""

    CONNECTING = "connecting"
    STREAMING = "streaming"
    BACKOFF = "backoff"
    #: The engine runs without a KV-event publisher (`UNIMPLEMENTED`); asked again every
    #: `unavailable_retry` seconds.
    UNAVAILABLE = "unavailable"
    #: No subscription (events off, or an engine without them); loads may still be polled.
    OFF = "off"


class _End(enum.Enum):
    """Why a stream ended."""

    CLOSED = "closed"  # the server ended it, or it broke: resume after a back-off
    IDLE = "idle"  # records stopped arriving on a stream that carried them: resume at once
    RESYNC = "resync"  # a gap: resubscribe from 0, keeping what is known
    LOST = "lost"  # KvStreamLost: clear, resubscribe from 0
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True, slots=True)
class FeedConfig:
    """How workers are followed; times in seconds but `wedge_ms`."""

    #: Subscribe to KV events where the engine offers them (`--kv-events auto`); False polls loads only.
    kv_events: bool = True
    #: Blocks each worker's index holds at most (`--kv-index-max-blocks`).
    max_blocks: int = DEFAULT_MAX_BLOCKS
    #: Output silence, with requests in flight, past which a worker is vetoed (`--engine-wedge-ms`;
    #: 0 turns the veto off).
    wedge_ms: float = 20_000.0
    #: Prompt tokens a second a healthy engine prefills at least: what pending prefill adds to the
    #: wedge bound (`--engine-prefill-rate`; 0 adds nothing).
    prefill_rate: float = 2_000.0
    #: Load polls while nothing is pushed (`--load-poll-interval`; 0 never polls).
    poll_interval: float = 1.0
    poll_timeout: float = 2.0
    backoff_initial: float = 0.1
    backoff_max: float = 5.0
    unavailable_retry: float = 60.0
    #: A stream that carried load records (heartbeats come every few seconds at most) and then went
    #: quiet this long is dropped and resumed: the peer may be gone without the transport noticing.
    stream_idle: float = 30.0

    def __post_init__(self) -> None:
        if self.max_blocks < 1:
            raise ValueError("the KV index needs room for at least one block")
        if min(self.wedge_ms, self.prefill_rate, self.poll_interval) < 0:
            raise ValueError("the wedge bound, the prefill rate and the poll interval cannot be negative")
        if self.poll_timeout <= 0 or not 0 < self.backoff_initial <= self.backoff_max:
            raise ValueError("the poll timeout and the back-off must be positive")


FEED_LABELS = ("worker", "url")


class KvEventMetrics(MetricSet):
    """Per-worker metrics of the feeds, on the app's `GatewayMetrics` registry. The gauges are set when
    the feeds refresh them (every poll interval, or each second), never per batch."""

    events = counter(
        "gateway_kv_events_total", "KV-cache events received from the worker's engine", FEED_LABELS
    )
    resyncs = counter(
        "gateway_kv_resyncs_total",
        "Times the worker's index was rebuilt or marked partial, by reason (stream_lost, "
        "publisher_restart, snapshot, gap)",
        (*FEED_LABELS, "reason"),
    )
    lag = gauge(
        "gateway_kv_event_lag_seconds",
        "Wall-clock delay of the last KV-event batch from the worker's engine",
        FEED_LABELS,
        multiprocess_mode="livemax",
    )
    index_blocks = gauge(
        "gateway_kv_index_blocks",
        "Blocks in the worker's prefix index",
        FEED_LABELS,
        multiprocess_mode="livemax",
    )
    index_complete = gauge(
        "gateway_kv_index_complete",
        "1 while the worker's index mirrors its engine's cache, 0 while partially known",
        FEED_LABELS,
        multiprocess_mode="livemin",
    )
    state = gauge(
        "gateway_kv_subscription_state",
        "1 for the state the worker's KV-event subscription is in (connecting, streaming, backoff, "
        "unavailable, off)",
        (*FEED_LABELS, "state"),
        multiprocess_mode="livemax",
    )
    wedged = gauge(
        "gateway_worker_wedged",
        "1 while the worker is kept from traffic because its engine reports silence past the bound",
        FEED_LABELS,
        multiprocess_mode="livemax",
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self._resync_series: set[tuple[str, str, str]] = set()

    def resync(self, worker: Worker, reason: str) -> None:
        labels = (worker.id, worker.public_url, reason)
        self._resync_series.add(labels)
        self.resyncs.labels(*labels).inc()

    def forget(self, worker: Worker) -> None:
        """Drop the worker's series (it left the fleet). Under multi-process metrics a removed gauge's
        last value stays in its file, so it is zeroed first."""
        labels = (worker.id, worker.public_url)
        for metric in (self.lag, self.index_blocks, self.index_complete, self.wedged):
            metric.labels(*labels).set(0)
            metric.remove(*labels)
        for state in FeedState:
            self.state.labels(*labels, state.value).set(0)
            self.state.remove(*labels, state.value)
        with contextlib.suppress(KeyError):
            self.events.remove(*labels)
        for series in [s for s in self._resync_series if s[:2] == labels]:
            self.resyncs.remove(*series)
            self._resync_series.discard(series)


class WorkerFeed:
    """One worker's subscription, load polls and wedge judgement; see the module docstring. Runs as one
    task (`run`) until cancelled."""

    def __init__(
        self,
        worker: Worker,
        config: FeedConfig,
        metrics: KvEventMetrics | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        self.worker = worker
        self.config = config
        self.metrics = metrics
        self._clock = clock
        self._sleep = sleep
        capabilities = worker.client.capabilities
        self.subscribes = config.kv_events and capabilities.kv_events
        self.polls = capabilities.loads and config.poll_interval > 0
        self.index: KvIndex | None = KvIndex(config.max_blocks) if self.subscribes else None
        worker.kv_index = self.index
        self.state = FeedState.CONNECTING if self.subscribes else FeedState.OFF
        #: The last sequence applied, per data-parallel rank.
        self.cursors: dict[int, int] = {}
        #: Subscriptions opened, and the start sequence each asked for (the last few).
        self.subscriptions = 0
        self.starts: list[int] = []
        #: Batches dropped as duplicates; load polls sent.
        self.duplicates = 0
        self.polls_sent = 0
        #: Poll-loop rounds, polled or not (tests wait on it).
        self.poll_checks = 0
        #: When the last load record was pushed (`clock()`), and the last batch arrived.
        self.pushed_at = -float("inf")
        self.last_batch_at = -float("inf")
        self.lag: float | None = None
        self._rank_loads: dict[int, EngineLoad] = {}
        self._fresh: set[int] = set()  # ranks without a batch yet on the current connection
        self._snapshot_rank: int | None = None  # a snapshot whose chunks are still arriving
        self._resync_asked = False
        self._stream_scope: anyio.CancelScope | None = None
        self._stream_loads = False
        self._events_seen = 0
        self._events_counted = 0
        self._changed = asyncio.Event()
        self._waiting = 0
        self.closed = False

    # -- running ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                if self.subscribes:
                    tg.start_soon(self._follow)
                tg.start_soon(self._tend)
        finally:
            self._set_wedged(False, None)

    async def until(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until `predicate()` holds, checking it whenever the feed applied something (a batch, a
        poll, a stream's end); raises TimeoutError after `timeout` seconds."""
        self._waiting += 1
        try:
            with anyio.fail_after(timeout):
                while not predicate():
                    await self._changed.wait()
        finally:
            self._waiting -= 1

    def _notify(self) -> None:
        if self._waiting:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _follow(self) -> None:
        delay = self.config.backoff_initial
        while True:
            start = 0 if self._resync_asked else self._resume_sequence()
            delivered, end = await self._stream(start)
            self._stream_scope = None
            if self._snapshot_rank is not None:
                # Chunks stopped arriving: the rank's record is partial; the next subscription asks from 0.
                if self.index is not None:
                    self.index.mark(self._snapshot_rank, False)
                self._snapshot_rank = None
                self._resync_asked = True
            self._set_wedged(False, None)  # no records to judge the engine by until the next stream
            self._notify()
            if end is _End.LOST:
                log.warning(
                    "the KV-event stream of worker %s cannot resume; rebuilding its index", self.worker.id
                )
                self._forget()
                self._resync_asked = False
                self._resync("stream_lost")
                if not delivered:
                    await self._back_off(delay)
                    delay = min(delay * 2, self.config.backoff_max)
                continue
            if end is _End.UNAVAILABLE:
                if self.state is not FeedState.UNAVAILABLE:
                    log.info(
                        "worker %s publishes no KV events (its engine runs without a publisher); asking again "
                        "every %gs",
                        self.worker.id,
                        self.config.unavailable_retry,
                    )
                self._set_state(FeedState.UNAVAILABLE)
                self.worker.kv_index = None
                await self._sleep(self.config.unavailable_retry)
                continue
            if end in (_End.RESYNC, _End.IDLE):
                continue
            if delivered:
                delay = self.config.backoff_initial
            await self._back_off(delay)
            delay = min(delay * 2, self.config.backoff_max)

    async def _back_off(self, delay: float) -> None:
        self._set_state(FeedState.BACKOFF)
        await self._sleep(delay * (0.5 + random.random() / 2))

    def _resume_sequence(self) -> int:
        """The cursor of the lowest rank (the servicers replay that rank's publisher), 0 for none."""
        return self.cursors[min(self.cursors)] if self.cursors else 0

    async def _stream(self, start: int) -> tuple[bool, _End]:
        """One subscription from `start`; returns whether it delivered a batch and why it ended."""
        if self.state is not FeedState.UNAVAILABLE:
            self._set_state(FeedState.CONNECTING)
        self.subscriptions += 1
        self.starts = [*self.starts[-15:], start]
        self._fresh = set(self.cursors)
        self._stream_loads = False
        delivered = False
        end = _End.CLOSED
        with anyio.CancelScope() as scope:
            self._stream_scope = scope
            stream: AsyncGenerator[KvBatch, None] | None = None
            try:
                stream = self.worker.client.subscribe_kv_events(start)
                async for batch in stream:
                    if not delivered:
                        delivered = True
                        self._set_state(FeedState.STREAMING)
                        self.worker.kv_index = self.index
                        if start == 0 and self._resync_asked:
                            log.info("worker %s: resubscribed from 0 to resync its KV index", self.worker.id)
                    if self.apply_batch(batch):
                        end = _End.RESYNC
                        break
            except KvStreamLost:
                end = _End.LOST
            except KvEventsUnavailable:
                end = _End.UNAVAILABLE
            except UpstreamError as exc:
                log.info("the KV-event stream of worker %s broke: %s", self.worker.id, exc.message)
            finally:
                if stream is not None:
                    with anyio.CancelScope(shield=True):
                        await stream.aclose()
        if scope.cancelled_caught:
            log.info("worker %s sent nothing for %gs; resubscribing", self.worker.id, self.config.stream_idle)
            end = _End.IDLE
        return delivered, end

    # -- batches ---------------------------------------------------------------------------------------
    def apply_batch(self, batch: KvBatch) -> bool:
        """Apply one batch as it arrived on the stream (its load record, then its events through the
        rank's cursor); True asks the caller to resubscribe from 0 (a gap to resync)."""
        now = self._clock()
        self.last_batch_at = now
        if batch.timestamp > 0:
            self.lag = time.time() - batch.timestamp
        rank = batch.dp_rank or 0
        load = batch.load
        if load is not None:
            self._on_load(rank, load, now)
        events = batch.events
        self._events_seen += len(events)
        index = self.index
        assert index is not None
        resync = False
        if batch.snapshot is not None:
            self._on_snapshot(batch, rank, index)
        elif load is None or not load.load_only:
            resync = self._admit(batch, rank, index)
        if self._waiting:
            self._notify()
        return resync

    def _admit(self, batch: KvBatch, rank: int, index: KvIndex) -> bool:
        seq = batch.sequence
        events = batch.events
        cursor = self.cursors.get(rank)
        fresh = rank in self._fresh
        if fresh:
            self._fresh.discard(rank)
        if cursor is not None and seq == cursor + 1:
            self.cursors[rank] = seq
            if index.apply(events, rank):
                self._known(rank, index)  # the engine cleared its cache: everything since is known
            return False
        if cursor is None:
            # The rank's first batch: known if it is its publisher's first, or clears the cache.
            self.cursors[rank] = seq
            if index.apply(events, rank) or seq == 0:
                self._known(rank, index)
            else:
                index.mark(rank, False)
            return False
        if seq <= cursor:
            clears = any(type(event) is CacheCleared for event in events)
            restarted = seq < cursor and (fresh or clears or seq <= 1 or seq + RESTART_WINDOW <= cursor)
            if not restarted:
                self.duplicates += 1
                return False
            log.info(
                "the KV-event publisher of worker %s (rank %d) started over at %d", self.worker.id, rank, seq
            )
            index.clear(rank)
            self.cursors[rank] = seq
            index.apply(events, rank)
            self._resync("publisher_restart")
            if seq == 0 or clears:
                self._known(rank, index)
            else:
                index.mark(rank, False)
            return False
        # A gap: what the missed batches did is unknown.
        self.cursors[rank] = seq
        if index.apply(events, rank):
            self._known(rank, index)
            return False
        log.warning(
            "worker %s (rank %d) skipped KV-event batches %d to %d; its index is partial until resynced",
            self.worker.id,
            rank,
            cursor + 1,
            seq - 1,
        )
        index.mark(rank, False)
        self._resync("gap")
        if self._resync_asked:
            return False  # asked once already; the relay has nothing better to serve
        self._resync_asked = True
        return True

    def _known(self, rank: int, index: KvIndex) -> None:
        index.mark(rank, True)
        if index.complete:
            self._resync_asked = False

    def _on_snapshot(self, batch: KvBatch, rank: int, index: KvIndex) -> None:
        chunk = batch.snapshot
        assert chunk is not None
        if chunk.index == 0 or self._snapshot_rank != rank:
            if chunk.index != 0:
                index.clear(rank)  # its first chunk, which clears, went missing
            log.info(
                "worker %s (rank %d): applying a KV-index snapshot of %d blocks in %d chunks",
                self.worker.id,
                rank,
                chunk.blocks,
                chunk.count,
            )
            self._snapshot_rank = rank
            index.mark(rank, False)
            self._resync("snapshot")
        index.apply(batch.events, rank)
        self.cursors[rank] = batch.sequence
        self._fresh.discard(rank)
        if chunk.index + 1 >= chunk.count:
            self._snapshot_rank = None
            if chunk.unknown_before:
                log.warning(
                    "worker %s (rank %d): the relay missed %d batches before its record; the index stays partial",
                    self.worker.id,
                    rank,
                    chunk.unknown_before,
                )
                index.mark(rank, False)
            else:
                self._known(rank, index)

    def _forget(self) -> None:
        self.cursors.clear()
        self._fresh.clear()
        self._snapshot_rank = None
        if self.index is not None:
            self.index.forget_ranks()

    def _resync(self, reason: str) -> None:
        if self.metrics is not None and not self.closed:
            self.metrics.resync(self.worker, reason)

    # -- loads and the wedge veto ----------------------------------------------------------------------
    def _on_load(self, rank: int, load: EngineLoad, now: float) -> None:
        loads = self._rank_loads
        loads[rank] = load
        combined = load if len(loads) == 1 else combine_loads(list(loads.values()))
        worker = self.worker
        worker.engine_load = combined
        worker.engine_load_at = now
        self.pushed_at = now
        self._stream_loads = True
        if self.config.wedge_ms > 0:
            self._judge(combined)

    def _judge(self, load: EngineLoad) -> None:
        silence = load.engine_silence_ms
        if silence is None:
            self._set_wedged(False, load)
            return
        bound = self.config.wedge_ms
        if self.config.prefill_rate > 0 and load.prefill_pending_tokens:
            bound += load.prefill_pending_tokens / self.config.prefill_rate * 1000.0
        if silence <= bound:
            self._set_wedged(False, load)
        elif self.worker.in_flight > 0:
            self._set_wedged(True, load)

    def _set_wedged(self, wedged: bool, load: EngineLoad | None) -> None:
        worker = self.worker
        if worker.wedged == wedged:
            return
        worker.wedged = wedged
        if wedged:
            log.warning(
                "worker %s is wedged: its engine produced nothing for %s ms with requests in flight; no "
                "traffic until it does",
                worker.id,
                load.engine_silence_ms if load is not None else "?",
            )
        else:
            log.info("worker %s is no longer wedged", worker.id)

    async def _tend(self) -> None:
        """Every poll interval (each second without polls): poll the load while nothing is pushed, drop a
        stream gone quiet, refresh the metrics."""
        interval = self.config.poll_interval or 1.0
        failures = 0  # polls failed in a row: the next waits longer, up to a minute
        while True:
            await self._sleep(min(interval * 2**failures, max(interval, 60.0)))
            now = self._clock()
            self.poll_checks += 1
            if (
                self._stream_scope is not None
                and self._stream_loads
                and now - self.last_batch_at > self.config.stream_idle
            ):
                self._stream_scope.cancel()
            if self.polls and now - self.pushed_at >= self.config.poll_interval:
                try:
                    with anyio.fail_after(self.config.poll_timeout):
                        load = await self.worker.client.loads(self.config.poll_timeout)
                except (UpstreamError, TimeoutError) as exc:
                    failures += 1
                    log.debug("polling the load of worker %s failed: %s", self.worker.id, exc)
                else:
                    failures = 0
                    self.polls_sent += 1
                    if self._clock() - self.pushed_at >= self.config.poll_interval:
                        self.worker.engine_load = load
                        self.worker.engine_load_at = self._clock()
            self.refresh_metrics()
            self._notify()

    # -- metrics ----------------------------------------------------------------------------------------
    def _set_state(self, state: FeedState) -> None:
        if state is self.state:
            return
        self.state = state
        self.refresh_metrics()

    def refresh_metrics(self) -> None:
        metrics = self.metrics
        if metrics is None or self.closed:
            return
        labels = (self.worker.id, self.worker.public_url)
        if self._events_seen > self._events_counted:
            metrics.events.labels(*labels).inc(self._events_seen - self._events_counted)
            self._events_counted = self._events_seen
        if self.lag is not None:
            metrics.lag.labels(*labels).set(max(0.0, self.lag))
        index = self.index
        metrics.index_blocks.labels(*labels).set(len(index) if index is not None else 0)
        metrics.index_complete.labels(*labels).set(1 if index is not None and index.complete else 0)
        metrics.wedged.labels(*labels).set(1 if self.worker.wedged else 0)
        for state in FeedState:
            metrics.state.labels(*labels, state.value).set(1 if state is self.state else 0)


class KvSubscriptions:
    """Every worker's feed, started when the worker joins the fleet and ended when it leaves (`attach`).
    Feeds run on `tasks`, so the app's shutdown ends them."""

    def __init__(
        self,
        tasks: TaskSupervisor,
        config: FeedConfig | None = None,
        metrics: KvEventMetrics | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        self.tasks = tasks
        self.config = config or FeedConfig()
        self.metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self.feeds: dict[str, WorkerFeed] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def attach(self, fleet: Fleet) -> None:
        """Follow `fleet`'s workers as they join and leave."""
        fleet.on_worker_joined.append(self.start)
        fleet.on_worker_removed.append(self.stop)

    def start(self, worker: Worker) -> None:
        """Follow `worker` if its engine pushes or answers anything (its feed is then in `feeds`); not
        once the app is shutting down."""
        if worker.id in self.feeds:
            return
        capabilities = worker.client.capabilities
        subscribes = self.config.kv_events and capabilities.kv_events
        if not subscribes and not (capabilities.loads and self.config.poll_interval > 0):
            return
        feed = WorkerFeed(worker, self.config, self.metrics, clock=self._clock, sleep=self._sleep)
        try:
            task = self.tasks.spawn(feed.run(), name=f"kv-feed {worker.id}")
        except SupervisorClosed:
            worker.kv_index = None
            return
        self.feeds[worker.id] = feed
        self._tasks[worker.id] = task

    def stop(self, worker: Worker) -> None:
        """Stop following `worker` (it left the fleet): its task is cancelled and its series dropped."""
        feed = self.feeds.pop(worker.id, None)
        task = self._tasks.pop(worker.id, None)
        if task is not None:
            task.cancel()
        if feed is None:
            return
        feed.closed = True
        worker.kv_index = None
        worker.wedged = False
        if self.metrics is not None:
            self.metrics.forget(worker)

    def refresh_metrics(self) -> None:
        for feed in self.feeds.values():
            feed.refresh_metrics()


__all__ = [
    "RESTART_WINDOW",
    "FeedConfig",
    "FeedState",
    "KvEventMetrics",
    "KvSubscriptions",
    "WorkerFeed",
]
