"""An unreachable OTLP collector: one warning, then silence while the exporter backs off (no work and no
line per span batch), and one line when the collector answers again. The collector is a real HTTP
server on loopback whose socket is bound but not listening (connections are refused) until it opens;
batches are exported by explicit flushes and the back-off is read from a test clock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harmony_gateway.observability import tracing
from harmony_gateway.observability.export import RETRY_FIRST, RETRY_MAX


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver that refuses connections until `open()`."""

    daemon_threads = True

    def __init__(self) -> None:
        self.batches = 0
        self.serving = False
        super().__init__(("127.0.0.1", 0), _Receive, bind_and_activate=False)
        self.server_bind()  # the port is ours, but nothing listens on it yet: connections are refused

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def open(self) -> None:
        self.server_activate()
        self.serving = True
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Receive(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.server.batches += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def collector() -> Iterator[Collector]:
    server = Collector()
    try:
        yield server
    finally:
        tracing.shutdown()
        if server.serving:
            server.shutdown()
        server.server_close()


def export_one_batch(name: str) -> None:
    with tracing.span(name):
        pass
    tracing.flush()


def export_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.name.startswith(("opentelemetry", "harmony_gateway.observability.export"))
    ]


def test_an_unreachable_collector_is_one_line_then_back_off_then_one_line_when_it_recovers(
    collector: Collector, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    clock = Clock()
    tracing.configure(collector.url, export_timeout=0.5, clock=clock)
    for batch in range(5):  # the first fails; the rest come while backing off: not even tried
        export_one_batch(f"down-{batch}")
    [failed] = export_lines(caplog)
    assert f"trace export to {collector.url}/v1/traces failed" in failed
    assert "failed (Failed to export spans batch" in failed  # the exporter's own account

    clock.now += RETRY_FIRST  # the back-off has passed: tried again, still down, still quiet
    export_one_batch("still-down")
    clock.now += RETRY_FIRST  # the back-off doubled: not passed yet
    export_one_batch("backing-off")
    assert export_lines(caplog) == [failed]

    collector.open()
    clock.now += RETRY_MAX
    export_one_batch("up")
    lines = export_lines(caplog)
    assert len(lines) == 2 and collector.batches == 1
    assert f"trace export to {collector.url}/v1/traces recovered" in lines[1]
    assert "7 spans were dropped" in lines[1]

    export_one_batch("up-again")  # healthy again: each batch goes out, quietly
    assert collector.batches == 2 and len(export_lines(caplog)) == 2
