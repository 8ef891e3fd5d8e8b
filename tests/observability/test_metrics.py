"""GatewayMetrics without a server: per-request recording, multi-process mode, scrape-time fleet gauges."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from harmony_gateway.observability.metrics import (
    METRIC_PREFIX,
    Declared,
    GatewayMetrics,
    MetricSet,
    counter,
    finish_request,
    histogram,
)
from harmony_gateway.pipeline.context import RequestContext
from harmony_gateway.principal import ANONYMOUS, TENANT_PREFIX, Principal


def samples(metrics: GatewayMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        for s in family.samples:
            out[s.name + str(sorted(s.labels.items()))] = s.value
    return out


def test_finish_request_records_once_with_one_itl_observation() -> None:
    metrics = GatewayMetrics()
    ctx = RequestContext(request_id="r", route="chat", model="m", metrics=metrics, started=100.0)
    ctx.first_token_at = 100.5
    ctx.completion_tokens = 11
    ctx.prompt_tokens = 7
    metrics.observe(ctx, now=101.5)
    s = samples(metrics)
    assert s["gateway_inter_token_latency_seconds_sum[('model', 'm'), ('route', 'chat')]"] == 0.1
    assert s["gateway_time_to_first_token_seconds_sum[('model', 'm'), ('route', 'chat')]"] == 0.5
    assert s["gateway_request_duration_seconds_sum[('model', 'm'), ('route', 'chat')]"] == 1.5
    finish_request(ctx)
    finish_request(ctx)  # idempotent: the second call records nothing
    s = samples(metrics)
    assert s["gateway_requests_total[('model', 'm'), ('route', 'chat'), ('status', '200')]"] == 2
    assert s["gateway_prompt_tokens_total[('model', 'm')]"] == 14


class _Declared(MetricSet):
    hits = counter("test_hits_total", "Hits by kind", ["kind"])
    wait = histogram("test_wait_seconds", "Waits", buckets=(1.0, 2.0))


def test_a_metric_set_builds_its_declared_metrics_on_each_instance_registry() -> None:
    first, second = _Declared(CollectorRegistry()), _Declared(CollectorRegistry())
    assert isinstance(first.hits, Counter) and isinstance(first.wait, Histogram)
    first.hits.labels(kind="a").inc(2)
    second.wait.observe(1.5)
    assert first.registry.get_sample_value("test_hits_total", {"kind": "a"}) == 2
    assert second.registry.get_sample_value("test_hits_total", {"kind": "a"}) is None
    assert second.registry.get_sample_value("test_wait_seconds_count") == 1
    names = [family.name for family in first.registry.collect()]
    assert names == ["test_hits", "test_wait_seconds"]  # declaration order


def test_multiprocess_mode_merges_process_files(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        from harmony_gateway.observability.metrics import GatewayMetrics
        m = GatewayMetrics()
        m.retries.labels(model="m").inc(3)
        print(m.render()[0].decode())
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(2):  # two "processes" write their own files; each scrape sees both
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
    assert 'gateway_retries_total{model="m"} 6.0' in out.stdout
    assert any(p.name.startswith("counter_") for p in tmp_path.iterdir())


def _metric_sets(cls: type[MetricSet]) -> Iterator[type[MetricSet]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _metric_sets(sub)


def test_every_declared_metric_has_the_one_prefix() -> None:
    """Every `MetricSet` of the gateway, configured or not, names its metrics `gateway_*` (the process
    gauges of multi-process mode keep prometheus-client's standard `process_*` names)."""
    for module in ("routing.dns_discovery", "routing.kv_subscriptions", "traffic.middleware"):
        importlib.import_module(f"harmony_gateway.{module}")
    sets = [cls for cls in _metric_sets(MetricSet) if cls.__module__.startswith("harmony_gateway.")]
    assert {"GatewayMetrics", "TrafficMetrics", "KvEventMetrics", "DnsMetrics"} <= {c.__name__ for c in sets}
    names = []
    for cls in sets:
        for value in vars(cls).values():
            if isinstance(value, Declared):
                registry = CollectorRegistry()
                value.build(registry)
                names += [family.name for family in registry.collect()]
    assert names
    allowed = (METRIC_PREFIX, "process_")
    assert [name for name in names if not name.startswith(allowed)] == []


def test_tokens_are_counted_by_key_id_never_for_an_open_gateway() -> None:
    metrics = GatewayMetrics()
    tenant = Principal(key_id="abc123", tenant=TENANT_PREFIX + "acme")
    for principal in (tenant, Principal(key_id="def456", tenant="def456"), ANONYMOUS):
        ctx = RequestContext(request_id="r", route="chat", model="m", metrics=metrics, principal=principal)
        ctx.prompt_tokens, ctx.completion_tokens = 7, 3
        finish_request(ctx)
    metrics.observe_tokens(tenant, "m", 5, 2)  # a background response's, when it ends
    s = samples(metrics)
    assert (
        s["gateway_key_prompt_tokens_total[('key_id', 'abc123'), ('model', 'm'), ('tenant', 'acme')]"] == 12
    )
    assert (
        s["gateway_key_completion_tokens_total[('key_id', 'abc123'), ('model', 'm'), ('tenant', 'acme')]"]
        == 5
    )
    assert s["gateway_key_prompt_tokens_total[('key_id', 'def456'), ('model', 'm'), ('tenant', '')]"] == 7
    assert s["gateway_prompt_tokens_total[('model', 'm')]"] == 3 * 7 + 5
    assert not [k for k in s if k.startswith("gateway_key_") and "('key_id', '')" in k]


_STAYS = """
import sys
from harmony_gateway.observability.metrics import GatewayMetrics
GatewayMetrics().refresh_files()
print("written", flush=True)
sys.stdin.read()
"""
_SCRAPES = """
import os
from harmony_gateway.observability.metrics import GatewayMetrics
print(os.getpid())
print(GatewayMetrics().render()[0].decode())
"""


def test_multiprocess_mode_shows_each_live_process_and_forgets_dead_ones(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}

    def scrape() -> tuple[str, dict[str, dict[str, float]]]:
        out = subprocess.run(
            [sys.executable, "-c", _SCRAPES], env=env, capture_output=True, text=True, check=True
        ).stdout
        pid, text = out.split("\n", 1)
        by_family: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                by_family.setdefault(s.name, {})[s.labels.get("pid", "")] = s.value
        return pid, by_family

    stays = subprocess.Popen(
        [sys.executable, "-c", _STAYS], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert stays.stdout is not None and stays.stdout.readline().strip() == "written"
        pid, found = scrape()
        assert set(found["process_resident_memory_bytes"]) == {str(stays.pid), pid}
        assert set(found["process_cpu_seconds_total"]) == {str(stays.pid), pid}
        assert all(v > 1024 * 1024 for v in found["process_resident_memory_bytes"].values())
        assert len(found["python_info"]) == 1
    finally:
        assert stays.stdin is not None
        stays.stdin.close()
        stays.wait(timeout=30)
    pid, found = scrape()  # the process that left is forgotten by the next scrape
    assert set(found["process_resident_memory_bytes"]) == {pid}
