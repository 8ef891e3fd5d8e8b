"""Prometheus metrics: one `GatewayMetrics` per app, recorded once per request and rendered at `/metrics`.

Nothing here runs per token. `finish_request(ctx)` is the single end-of-request hook: it records the
request's counters and histograms from the `RequestContext` (inter-token latency is observed once, as
(end - first token) / (tokens - 1)) and then writes the request log line. Worker health, in-flight counts
and circuit-breaker state are read from the fleet at scrape time by `FleetCollector`, so requests never
touch those gauges. Each group of metrics (these, and traffic control's) is a `MetricSet`: its metrics
are declared as class attributes (`counter`, `histogram`, `gauge`) and built on the set's registry.

Multi-process servers: when `PROMETHEUS_MULTIPROC_DIR` is set before the gateway starts, prometheus-client
keeps counter and histogram values in files in that directory and `render()` merges every process's
files (`MultiProcessCollector`). The fleet gauges are then written to those files too, by every process
at each worker reconcile (about once a second, routing/shared_registry.py) and by the answering process at
the scrape, and merged: `gateway_worker_in_flight` sums the live processes, `gateway_worker_healthy` is
the largest live value (health is shared, so they agree), and `gateway_worker_circuit_breaker_state`
counts the live processes whose breaker for the worker is in each state (breakers are per process).

prometheus-client's standard families are on the app's registry too: `process_*` (memory, CPU, file
descriptors, start time) and `python_*` (version, garbage collector). With several processes each one
writes its own `process_*` values to its files at the same moments as the worker gauges, shown with a
`pid` label for every live process (a sum over them is the gateway's footprint); `python_info` is the
same in all of them, and the collector's per-process garbage counts are left out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, NamedTuple, TypeVar, overload

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from .logging import log_request
from .observed import (
    ObservedParser,
    ObservedPrincipal,
    ObservedRequest,
    ObservedTextStats,
    ObservedWorker,
)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
#: `routing.workers.BreakerState` values, named here so observability imports nothing from routing.
BREAKER_STATES = ("closed", "open", "half_open")
WORKER_LABELS = ("worker", "url", "kind", "model", "engine")
ROUTE_MODEL = ("route", "model")
KEY_MODEL = ("key_id", "tenant", "model")
#: The one prefix of every metric the gateway defines (beside prometheus-client's process_* and python_*).
METRIC_PREFIX = "gateway_"

MetricT = TypeVar("MetricT", Counter, Gauge, Histogram)
#: How prometheus-client merges a gauge's per-process values (`Gauge(multiprocess_mode=...)`).
MultiprocessMode = Literal[
    "all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent", "livemostrecent"
]


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


class FleetCollector:
    """Worker gauges, collected from the fleet when Prometheus scrapes (never updated per request)."""

    def __init__(self, workers: Callable[[], Iterable[ObservedWorker]]) -> None:
        self._workers = workers

    def describe(self) -> list[Metric]:
        return []  # collected on demand; nothing to check for name clashes at registration

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "gateway_worker_healthy", "1 if the worker passes health checks", labels=WORKER_LABELS
        )
        in_flight = GaugeMetricFamily(
            "gateway_worker_in_flight",
            "Requests the gateway has in flight on the worker",
            labels=WORKER_LABELS,
        )
        breaker = GaugeMetricFamily(
            "gateway_worker_circuit_breaker_state",
            "1 for the worker's current circuit-breaker state (closed, open, half_open), else 0",
            labels=["worker", "url", "state"],
        )
        for w in self._workers():
            values = [w.id, w.public_url, w.kind.value, w.model_id, w.engine]
            healthy.add_metric(values, 1.0 if w.healthy else 0.0)
            in_flight.add_metric(values, float(w.in_flight))
            current = w.breaker.value
            for state in BREAKER_STATES:
                breaker.add_metric([w.id, w.public_url, state], 1.0 if current == state else 0.0)
        yield healthy
        yield in_flight
        yield breaker


class Declared(Generic[MetricT]):
    """A metric declared as a class attribute of a `MetricSet` (made by `counter`, `histogram` or
    `gauge`); every instance of the set builds its own on the set's registry."""

    def __init__(self, build: Callable[[CollectorRegistry], MetricT]) -> None:
        self.build: Callable[[CollectorRegistry], MetricT] = build

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> Declared[MetricT]: ...

    @overload
    def __get__(self, instance: MetricSet, owner: type[Any]) -> MetricT: ...

    def __get__(self, instance: MetricSet | None, owner: type[Any]) -> Declared[MetricT] | MetricT:
        if instance is None:
            return self
        # The set's __init__ puts the built metric on the instance, which hides this descriptor.
        raise AttributeError(f"{owner.__name__} was not initialised by MetricSet.__init__")


class MetricSet:
    """Metrics declared as class attributes, registered on one `CollectorRegistry` per instance (in
    declaration order), so each instance's attributes are its own `Counter`, `Histogram` or `Gauge`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        for cls in reversed(type(self).__mro__):
            for attribute, value in vars(cls).items():
                if isinstance(value, Declared):
                    setattr(self, attribute, value.build(registry))


def counter(name: str, documentation: str, labels: Sequence[str] = ()) -> Declared[Counter]:
    return Declared(lambda registry: Counter(name, documentation, labels, registry=registry))


def histogram(
    name: str, documentation: str, labels: Sequence[str] = (), *, buckets: Sequence[float]
) -> Declared[Histogram]:
    return Declared(
        lambda registry: Histogram(name, documentation, labels, buckets=buckets, registry=registry)
    )


def gauge(
    name: str, documentation: str, labels: Sequence[str] = (), *, multiprocess_mode: MultiprocessMode
) -> Declared[Gauge]:
    return Declared(
        lambda registry: Gauge(
            name, documentation, labels, registry=registry, multiprocess_mode=multiprocess_mode
        )
    )


class GatewayMetrics(MetricSet):
    """The gateway's metrics on a per-app `CollectorRegistry` (two apps in one process never collide)."""

    requests = counter(
        "gateway_requests_total", "Requests by route, model and HTTP status", (*ROUTE_MODEL, "status")
    )
    latency = histogram(
        "gateway_request_duration_seconds",
        "End-to-end request latency, until the last byte",
        ROUTE_MODEL,
        buckets=LATENCY_BUCKETS,
    )
    ttft = histogram(
        "gateway_time_to_first_token_seconds",
        "From request arrival to the engine's first output",
        ROUTE_MODEL,
        buckets=TTFT_BUCKETS,
    )
    itl = histogram(
        "gateway_inter_token_latency_seconds",
        "Mean time between output tokens, one observation per request",
        ROUTE_MODEL,
        buckets=ITL_BUCKETS,
    )
    prompt_tokens = counter("gateway_prompt_tokens_total", "Prompt tokens sent to engines", ["model"])
    completion_tokens = counter(
        "gateway_completion_tokens_total", "Completion tokens received from engines", ["model"]
    )
    # Chargeback: tokens by API key (its id, a hash, never the key) and the key file's tenant name.
    key_prompt_tokens = counter(
        "gateway_key_prompt_tokens_total",
        "Prompt tokens sent to engines for each API key (by key id) and its tenant",
        KEY_MODEL,
    )
    key_completion_tokens = counter(
        "gateway_key_completion_tokens_total",
        "Completion tokens received from engines for each API key (by key id) and its tenant",
        KEY_MODEL,
    )
    retries = counter(
        "gateway_retries_total", "Engine requests retried on another worker before any output", ["model"]
    )
    # The Responses tool loop (surfaces/responses/service/turns.py, mcp/tool_loop.py).
    mcp_iterations = histogram(
        "gateway_mcp_iterations",
        "Model generations per Responses request that offered gateway-executed tools",
        ["model"],
        buckets=(1, 2, 3, 4, 5, 6, 8, 10, 15, 20),
    )
    mcp_tool_calls = counter(
        "gateway_mcp_tool_calls_total",
        "Gateway-executed tool calls by server, tool and outcome "
        "(success, tool_error, error, timeout, invalid_arguments)",
        ["server", "tool", "outcome"],
    )
    mcp_tool_latency = histogram(
        "gateway_mcp_tool_duration_seconds",
        "Duration of gateway-executed tool calls",
        ["server", "tool"],
        buckets=LATENCY_BUCKETS,
    )
    harmony_requests = counter("gateway_harmony_requests_total", "Requests served by a Harmony model")
    unbacked_tools_dropped = counter(
        "gateway_unbacked_tools_dropped_total",
        "Hosted tools left out of a prompt because nothing on the gateway backs them",
        ["type"],
    )
    harmony_reasoning_budget_exceeded = counter(
        "gateway_harmony_reasoning_budget_exceeded_total",
        "Requests whose analysis hit the reasoning budget and were moved on to the final answer",
        ROUTE_MODEL,
    )
    harmony_parsing_errors = counter(
        "gateway_harmony_parsing_errors_total", "Choices whose Harmony output stopped being parseable"
    )
    harmony_channel_messages = counter(
        "gateway_harmony_channel_messages_total",
        "Harmony messages parsed from model output, by channel",
        ["channel"],
    )
    # Recoveries of the token-level parser (by kind) and of the text-level one (HTTP upstreams,
    # non-Harmony models; kind "text", fed from `ParserStats`).
    harmony_channel_unexpected_order = counter(
        "gateway_harmony_channel_unexpected_order_total",
        "Messages out of the expected order: analysis/commentary after a final answer, or a reply ended "
        "by <|return|> on a message that is not the answer",
    )
    harmony_channel_parse_errors = counter(
        "gateway_harmony_channel_parse_errors_total",
        "Malformed spans in model output the parsers recovered from, by kind",
        ["kind"],
    )
    harmony_marker_fallback = counter(
        "gateway_harmony_marker_fallback_total",
        "Text outputs without Harmony markers that fell back to a marker or to pass-through",
        ["fallback"],
    )
    harmony_reasoning_answer_ratio = histogram(
        "gateway_harmony_reasoning_answer_ratio",
        "Reasoning characters per answer character, one observation per choice with an answer",
        buckets=RATIO_BUCKETS,
    )

    def __init__(self, workers: Callable[[], Iterable[ObservedWorker]] | None = None) -> None:
        super().__init__(CollectorRegistry())
        r = self.registry
        self._series: dict[tuple[str, str, int], _RequestSeries] = {}
        self._key_series: dict[tuple[str, str, str], tuple[Counter, Counter]] = {}
        #: Called before each scrape is rendered: what keeps gauges of its own refreshed (the KV-event
        #: feeds' per-worker gauges) brings them up to date.
        self.before_render: list[Callable[[], None]] = []
        self._workers = workers
        self._fleet = FleetCollector(workers) if workers is not None else None
        self._fleet_gauges: _FleetGauges | None = None
        self._process_gauges: _ProcessGauges | None = None
        self._scrape_registry = r
        if multiprocess_dir():
            # Values live in per-process files; a fresh registry merges them at every scrape.
            self._scrape_registry = CollectorRegistry()
            # prometheus_client leaves this constructor unannotated.
            MultiProcessCollector(self._scrape_registry)  # type: ignore[no-untyped-call]
            if workers is not None:
                self._fleet_gauges = _FleetGauges(r)
            # Each process's own process_* values, one series per live process (`pid`); python_info
            # is the same in every process. A process's collector garbage counts are not merged.
            self._process_gauges = _ProcessGauges(r)
            PlatformCollector(registry=self._scrape_registry)
        else:
            if self._fleet is not None:
                r.register(self._fleet)
            # prometheus-client's default collectors, on this app's registry: process_*, python_*.
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)

    def observe(self, ctx: ObservedRequest, now: float | None = None) -> None:
        """Record one finished request (called once, from `finish_request`)."""
        now = time.perf_counter() if now is None else now
        model = ctx.model or "unknown"
        route = ctx.route
        series = self._series.get((route, model, ctx.status))
        if series is None:
            # `labels()` costs a few microseconds a call; a request records up to six series.
            series = self._series[(route, model, ctx.status)] = _RequestSeries(
                self.requests.labels(route, model, str(ctx.status)),
                self.latency.labels(route, model),
                self.prompt_tokens.labels(model),
                self.completion_tokens.labels(model),
                self.ttft.labels(route, model),
                self.itl.labels(route, model),
            )
        series.requests.inc()
        series.latency.observe(now - ctx.started)
        if ctx.prompt_tokens:
            series.prompt_tokens.inc(ctx.prompt_tokens)
        if ctx.completion_tokens:
            series.completion_tokens.inc(ctx.completion_tokens)
        if ctx.principal.key_id and (ctx.prompt_tokens or ctx.completion_tokens):
            self._observe_key_tokens(ctx.principal, model, ctx.prompt_tokens, ctx.completion_tokens)
        first = ctx.first_token_at
        if first is not None:
            series.ttft.observe(first - ctx.started)
            if ctx.completion_tokens > 1:
                series.itl.observe((now - first) / (ctx.completion_tokens - 1))
        if ctx.log_extra.get("reasoning_budget_exceeded"):
            self.harmony_reasoning_budget_exceeded.labels(route, model).inc()
        if ctx.parsers:
            self.observe_harmony(ctx.parsers)
        if ctx.text_stats:
            self.observe_text_stats(ctx.text_stats)

    def observe_tokens(
        self, principal: ObservedPrincipal, model: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """Record the tokens of work that outlives its request (a background response), by model and by
        key; its request was recorded on its own, without them."""
        if prompt_tokens:
            self.prompt_tokens.labels(model).inc(prompt_tokens)
        if completion_tokens:
            self.completion_tokens.labels(model).inc(completion_tokens)
        if principal.key_id and (prompt_tokens or completion_tokens):
            self._observe_key_tokens(principal, model, prompt_tokens, completion_tokens)

    def _observe_key_tokens(
        self, principal: ObservedPrincipal, model: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        labels = (principal.key_id, principal.tenant_name, model)
        series = self._key_series.get(labels)
        if series is None:
            series = self._key_series[labels] = (
                self.key_prompt_tokens.labels(*labels),
                self.key_completion_tokens.labels(*labels),
            )
        if prompt_tokens:
            series[0].inc(prompt_tokens)
        if completion_tokens:
            series[1].inc(completion_tokens)

    def observe_harmony(self, parsers: Sequence[ObservedParser]) -> None:
        """Record one Harmony request from its output parsers (choices, or tool-loop iterations).

        Also called directly for work that outlives its request (background responses)."""
        if not parsers:
            return
        self.harmony_requests.inc()
        for channel, count in channel_counts(parsers).items():
            self.harmony_channel_messages.labels(channel).inc(count)
        errors = sum(1 for p in parsers if p.parse_error is not None)
        if errors:
            self.harmony_parsing_errors.inc(errors)
        for parser in parsers:
            for kind, count in parser.recoveries.items():
                self.harmony_channel_parse_errors.labels(kind).inc(count)
            if parser.unexpected_order:
                self.harmony_channel_unexpected_order.inc(parser.unexpected_order)

    def observe_text_stats(self, stats: Iterable[ObservedTextStats]) -> None:
        """Record the `ParserStats` of one request's text-level output parsers."""
        for st in stats:
            for channel, count in st.channel_messages.items():
                self.harmony_channel_messages.labels(channel).inc(count)
            if st.unexpected_order:
                self.harmony_channel_unexpected_order.inc(st.unexpected_order)
            if st.parse_errors:
                self.harmony_channel_parse_errors.labels("text").inc(st.parse_errors)
            if st.marker_fallbacks:
                self.harmony_marker_fallback.labels("marker").inc(st.marker_fallbacks)
            if st.passthrough_fallbacks:
                self.harmony_marker_fallback.labels("passthrough").inc(st.passthrough_fallbacks)
            if st.content_chars:
                self.harmony_reasoning_answer_ratio.observe(st.reasoning_chars / st.content_chars)

    def refresh_files(self) -> None:
        """Multi-process mode: write this process's worker gauges and its process_* values to its
        files and drop the files of processes that are gone (else nothing to do)."""
        if self._process_gauges is not None:
            self._process_gauges.update()
        if self._fleet_gauges is not None and self._workers is not None:
            self._fleet_gauges.update(self._workers())
        directory = multiprocess_dir()
        if directory and self._process_gauges is not None:
            reap_dead_processes(directory)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        for refresh in self.before_render:
            refresh()
        self.refresh_files()
        return generate_latest(self._scrape_registry), CONTENT_TYPE_LATEST


class _FleetGauges(MetricSet):
    """`FleetCollector`'s gauges as multi-process gauges, set from the fleet when refreshed."""

    healthy = gauge(
        "gateway_worker_healthy",
        "1 if the worker passes health checks",
        WORKER_LABELS,
        multiprocess_mode="livemax",
    )
    in_flight = gauge(
        "gateway_worker_in_flight",
        "Requests the gateway has in flight on the worker, over all its processes",
        WORKER_LABELS,
        multiprocess_mode="livesum",
    )
    breaker = gauge(
        "gateway_worker_circuit_breaker_state",
        "Gateway processes whose circuit breaker for the worker is in this state (closed, open, half_open)",
        ["worker", "url", "state"],
        multiprocess_mode="livesum",
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self._seen: set[tuple[str, ...]] = set()

    def update(self, workers: Iterable[ObservedWorker]) -> None:
        seen: set[tuple[str, ...]] = set()
        for w in workers:
            values: tuple[str, ...] = (w.id, w.url, w.kind.value, w.model_id, w.engine)
            seen.add(values)
            self.healthy.labels(*values).set(1.0 if w.healthy else 0.0)
            self.in_flight.labels(*values).set(float(w.in_flight))
            for state in BREAKER_STATES:
                self.breaker.labels(w.id, w.url, state).set(1.0 if w.breaker.value == state else 0.0)
        for values in self._seen - seen:
            # A removed worker (or one whose model became known): the files keep the last value of a
            # removed series, so zero it first; it then adds nothing to the sums.
            for gauge in (self.healthy, self.in_flight):
                gauge.labels(*values).set(0.0)
                gauge.remove(*values)
            if not any(v[0] == values[0] for v in seen):
                for state in BREAKER_STATES:
                    self.breaker.labels(values[0], values[1], state).set(0.0)
                    self.breaker.remove(values[0], values[1], state)
        self._seen = seen


class _ProcessGauges(MetricSet):
    """Multi-process mode: this process's `process_*` values (prometheus-client's `ProcessCollector`
    reads them) as `liveall` gauges, so a scrape shows every live process's own, labelled `pid`."""

    resident_memory = gauge(
        "process_resident_memory_bytes", "Resident memory size in bytes", multiprocess_mode="liveall"
    )
    virtual_memory = gauge(
        "process_virtual_memory_bytes", "Virtual memory size in bytes", multiprocess_mode="liveall"
    )
    cpu_seconds = gauge(
        "process_cpu_seconds_total",
        "Total user and system CPU time spent in seconds",
        multiprocess_mode="liveall",
    )
    open_fds = gauge("process_open_fds", "Number of open file descriptors", multiprocess_mode="liveall")
    max_fds = gauge("process_max_fds", "Maximum number of open file descriptors", multiprocess_mode="liveall")
    start_time = gauge(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds",
        multiprocess_mode="liveall",
    )

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self._reader = ProcessCollector(registry=None)
        self._by_name = {
            "process_resident_memory_bytes": self.resident_memory,
            "process_virtual_memory_bytes": self.virtual_memory,
            "process_cpu_seconds_total": self.cpu_seconds,
            "process_open_fds": self.open_fds,
            "process_max_fds": self.max_fds,
            "process_start_time_seconds": self.start_time,
        }

    def update(self) -> None:
        for family in self._reader.collect():
            for sample in family.samples:
                target = self._by_name.get(sample.name)
                if target is not None:
                    target.set(sample.value)


def reap_dead_processes(directory: str) -> None:
    """Drop the live-gauge files of processes that are gone (a killed process a supervisor replaced).

    prometheus-client counts a `live*` gauge file until `mark_process_dead(pid)` removes it, and uvicorn's
    supervisor has no hook for that, so the survivors do it; counters and histograms keep their files.
    """
    for path in Path(directory).glob("gauge_live*_*.db"):
        pid = path.stem.rsplit("_", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            mark_process_dead(int(pid), directory)  # type: ignore[no-untyped-call]
        except PermissionError:
            pass  # alive, another user's


class _RequestSeries(NamedTuple):
    """The labelled series one request records, for one (route, model, status)."""

    requests: Counter
    latency: Histogram
    prompt_tokens: Counter
    completion_tokens: Counter
    ttft: Histogram
    itl: Histogram


def channel_counts(parsers: Iterable[ObservedParser]) -> dict[str, int]:
    """Messages per Harmony channel over the parsers' output ("none" for a message without a channel)."""
    counts: dict[str, int] = {}
    for parser in parsers:
        for msg in parser.messages:
            channel = msg.channel or "none"
            counts[channel] = counts.get(channel, 0) + 1
    return counts


def finish_request(ctx: ObservedRequest) -> None:
    """End of a request: record its metrics (when the app has metrics) and log its one line. Idempotent."""
    if ctx.finished:
        return
    ctx.finished = True
    if not ctx.completion_tokens and ctx.parsers:
        # Streams without usage never computed the total; the parsers counted every token fed.
        ctx.completion_tokens = sum(p.output_tokens for p in ctx.parsers)
    if ctx.metrics is not None:
        ctx.metrics.observe(ctx)
    log_request(ctx)


__all__ = [
    "METRIC_PREFIX",
    "FleetCollector",
    "GatewayMetrics",
    "MetricSet",
    "channel_counts",
    "counter",
    "finish_request",
    "gauge",
    "histogram",
    "multiprocess_dir",
]
