"""`QuietExporter`: the span exporter `tracing.configure` installs around OTLP's, so a collector that
cannot be reached costs one log line and no work, not three lines per span batch forever.

The OTLP exporter logs each failed batch itself (a warning per retry, then an error) and spends its
whole timeout retrying, every batch. Here its records are held back while it exports (`_HeldBack`, on
its loggers, for the exporting thread only); the first failure is one warning naming the collector and
the reason, and the next attempt waits out a back-off that doubles from `RETRY_FIRST` to `RETRY_MAX`
seconds, dropping the batches that come meanwhile. The export that succeeds again is one line saying
so, with the number of spans lost. Imported only when tracing is on (it loads the OpenTelemetry SDK).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)

#: Seconds before the collector is tried again after a failure, doubling up to RETRY_MAX.
RETRY_FIRST = 1.0
RETRY_MAX = 60.0
#: The loggers the OTLP/HTTP exporter writes its per-batch failures to.
EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.common.http",
)


class _HeldBack(logging.Filter):
    """Drops the records a thread writes while `holding` is set for it, keeping the first one's message
    since holding began (the exporter's own account of why the batch failed: its first retry names the
    cause, its last line only that it gave up)."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    def holding(self, on: bool) -> None:
        self._local.on = on
        if on:
            self._local.first = ""

    @property
    def first(self) -> str:
        return str(getattr(self._local, "first", ""))

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(self._local, "on", False):
            if not self._local.first:
                self._local.first = record.getMessage()
            return False
        return True


class QuietExporter(SpanExporter):
    """`inner`, exporting to `where`, with its failures reported once and retried with back-off.

    `clock` is monotonic seconds (tests pass their own). Thread-safe: the batch processor's worker and a
    flush may export at once."""

    def __init__(
        self, inner: SpanExporter, where: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._inner = inner
        self._where = where
        self._clock = clock
        self._lock = threading.Lock()
        self._held = _HeldBack()
        for name in EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(self._held)
        #: When the collector first failed, None while it answers.
        self._failing_since: float | None = None
        self._delay = RETRY_FIRST
        self._retry_at = 0.0
        #: Spans lost since the collector failed.
        self.dropped = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._failing_since is not None and self._clock() < self._retry_at:
                self.dropped += len(spans)
                return SpanExportResult.FAILURE
            self._held.holding(True)
            reason = ""
            try:
                result = self._inner.export(spans)
            except Exception as exc:  # an exporter bug must not stop the batch processor's thread
                result, reason = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
            finally:
                self._held.holding(False)
            now = self._clock()
            if result is SpanExportResult.SUCCESS:
                if self._failing_since is not None:
                    log.warning(
                        "trace export to %s recovered after %.0fs; %d spans were dropped meanwhile",
                        self._where,
                        now - self._failing_since,
                        self.dropped,
                    )
                    self._failing_since, self._delay, self.dropped = None, RETRY_FIRST, 0
                return result
            self.dropped += len(spans)
            if self._failing_since is None:
                self._failing_since, self._delay = now, RETRY_FIRST
                log.warning(
                    "trace export to %s failed (%s); spans are dropped and the collector is tried again "
                    "after %gs, then less often (up to every %gs); a line follows when it recovers",
                    self._where,
                    reason or self._held.first or "no reason given",
                    RETRY_FIRST,
                    RETRY_MAX,
                )
            else:
                self._delay = min(self._delay * 2, RETRY_MAX)
            self._retry_at = now + self._delay
            return result

    def shutdown(self) -> None:
        self._held.holding(True)
        try:
            self._inner.shutdown()
        finally:
            self._held.holding(False)
            for name in EXPORTER_LOGGERS:
                logging.getLogger(name).removeFilter(self._held)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


__all__ = ["RETRY_FIRST", "RETRY_MAX", "QuietExporter"]
