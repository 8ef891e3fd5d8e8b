"""OpenTelemetry tracing, off unless `serve --otlp-endpoint URL` configures an exporter.

One span per HTTP request (`traffic.middleware` starts it, continuing the client's W3C `traceparent`),
with children: `gateway.prepare`, `gateway.route`, `gateway.engine` (the engine call up to its first
output), `gateway.stream` (from the response's first byte to its last), `gateway.mcp.call` and
`gateway.storage.<operation>`. The engine call carries the current trace context in its gRPC metadata
(`grpc_metadata`), which SGLang and vLLM read. Spans never carry prompt text unless `--log-prompts`.

While tracing is off every helper here is a cheap no-op: the API's default tracer records nothing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer = trace.NoOpTracer()
_provider: Any = None

T = TypeVar("T")


def enabled() -> bool:
    return _provider is not None


def configure(
    endpoint: str,
    service_name: str = "harmony-gateway",
    *,
    export_timeout: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Export spans over OTLP/HTTP to `endpoint` (a collector's base URL, e.g. http://host:4318), each
    batch within `export_timeout` seconds. A collector that cannot be reached is logged once and tried
    again with back-off (`export.QuietExporter`, which reads `clock`)."""
    global _tracer, _provider
    # lazy: the OpenTelemetry SDK and its OTLP exporter load only when --otlp-endpoint turns tracing on
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from .export import QuietExporter  # lazy: imports the OpenTelemetry SDK

    url = endpoint.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = QuietExporter(OTLPSpanExporter(endpoint=url, timeout=export_timeout), url, clock=clock)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    # Per app, not the process-global provider: a process may build several apps (tests), and the
    # global provider can be set only once.
    _provider = provider
    _tracer = provider.get_tracer("harmony_gateway")
    log.info("exporting traces to %s", url)


def flush() -> None:
    """Export the spans ended so far now, in this thread (blocks until the collector answers, or the
    export times out or is skipped while backing off)."""
    if _provider is not None:
        _provider.force_flush()


def shutdown() -> None:
    """Flush and stop the exporter (lifespan end)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _provider = None
    _tracer = trace.NoOpTracer()


def start_request_span(name: str, headers: Mapping[str, str], attributes: dict[str, Any]) -> tuple[Any, Any]:
    """The request's root span, continuing the client's `traceparent`, made current; returns
    (span, token) for `end_request_span`. (None, None) while tracing is off."""
    if _provider is None:
        return None, None
    parent = _PROPAGATOR.extract(headers)
    span = _tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    return span, token


def end_request_span(span: Any, token: Any, status: int | None) -> None:
    if span is None:
        return
    if status is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(trace.Status(trace.StatusCode.ERROR))
    span.end()
    with contextlib.suppress(ValueError):  # detached in another context (a cancelled task)
        otel_context.detach(token)


def annotate_prompt(field: str, value: Any) -> None:
    """Record a prompt field on the request's span (callers do so only with --log-prompts)."""
    if _provider is None:
        return
    trace.get_current_span().set_attribute(f"gateway.prompt.{field}", orjson.dumps(value).decode())


def start_span(name: str, attributes: dict[str, Any] | None = None) -> Any:
    """A child of the current span, not made current (for spans that end in another frame)."""
    if _provider is None:
        return None
    return _tracer.start_span(name, attributes=attributes)


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Any]:
    if _provider is None:
        yield None
        return
    with _tracer.start_as_current_span(name, attributes=attributes) as current:
        yield current


def traced(name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a function (sync or async) to run inside a span named `name`."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                if _provider is None:
                    return await fn(*args, **kwargs)
                with _tracer.start_as_current_span(name):
                    return await fn(*args, **kwargs)

            return run_async

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if _provider is None:
                return fn(*args, **kwargs)
            with _tracer.start_as_current_span(name):
                return fn(*args, **kwargs)

        return run

    return wrap


def grpc_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current trace context as gRPC metadata (`traceparent`, `tracestate`); None when off."""
    if _provider is None:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return tuple(carrier.items()) or None


class TracedStore:
    """A storage backend whose every coroutine method runs in a `gateway.storage.<name>` span."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._store, name)
        if name.startswith("_") or not callable(value):
            return value
        if not inspect.iscoroutinefunction(value):
            return value

        @functools.wraps(value)
        async def call(*args: Any, **kwargs: Any) -> Awaitable[Any]:
            if _provider is None:
                return await value(*args, **kwargs)  # type: ignore[no-any-return]
            with _tracer.start_as_current_span(f"gateway.storage.{name}"):
                return await value(*args, **kwargs)  # type: ignore[no-any-return]

        return call
