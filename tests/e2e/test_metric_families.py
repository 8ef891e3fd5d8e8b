"""What `/metrics` shows an operator, scraped from a running gateway: one prefix for every family the
gateway defines, prometheus-client's standard process and Python families, and the gauges of a
component only when that component is configured (no false alarm from a Redis that was never set up)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harmony_gateway.observability.metrics import METRIC_PREFIX
from harmony_gateway.sim import SimConfig
from tests.conftest import MODEL
from tests.e2e._fleet import chat, sims
from tests.support.servers import running_gateway, test_settings
from tests.traffic._support import REDIS_URL, redis_keys, require_redis  # noqa: F401  (a fixture)

#: prometheus-client's default collectors: process_* (ProcessCollector), python_* (Platform, GC).
STANDARD_PREFIXES = ("process_", "python_")
#: Families of components a gateway runs only when configured.
STORE_GAUGE = "gateway_rate_limit_store_up"
ADMISSION_GAUGES = {"gateway_admission_in_flight", "gateway_admission_queue_depth"}


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {
        family.name: [(s.labels, s.value) for s in family.samples]
        for family in text_string_to_metric_families(text)
    }


async def traffic(http: httpx.AsyncClient) -> None:
    """A little of everything the metrics record: a served chat, a stream, an unknown model, a parse."""
    assert (await chat(http)).status_code == 200
    assert (await chat(http, stream=True)).status_code == 200
    assert (await chat(http, model="no-such-model")).status_code == 404
    parsed = await http.post("/v1/harmony/parse", json={"text": "<|channel|>final<|message|>Hi<|end|>"})
    assert parsed.status_code == 200


@pytest.mark.usefixtures("require_redis")
async def test_every_family_has_the_one_prefix_with_every_component_configured() -> None:
    async with sims(SimConfig()) as (engine,), redis_keys():
        settings = test_settings(
            worker_urls=(engine.url,),
            rate_limit=10_000,
            token_rate_limit=10_000_000,
            rate_limit_store=REDIS_URL,
            max_concurrent_requests=8,
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await traffic(http)
            found = families((await http.get("/metrics")).text)
    ours = {name for name in found if not name.startswith(STANDARD_PREFIXES)}
    assert ours, found
    assert {name for name in ours if not name.startswith(METRIC_PREFIX)} == set()
    # The configured components' gauges are there, reading what they watch.
    assert found[STORE_GAUGE] == [({}, 1.0)]
    assert ADMISSION_GAUGES <= set(found)
    assert "gateway_worker_healthy" in found and "gateway_requests" in found


async def test_no_gauge_for_what_is_not_configured() -> None:
    async with sims(SimConfig()) as (engine,):
        settings = test_settings(worker_urls=(engine.url,), rate_limit=10_000)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await traffic(http)
            text = (await http.get("/metrics")).text
    found = families(text)
    assert STORE_GAUGE not in text  # not even its HELP line: budgets are per process, by design
    assert not ADMISSION_GAUGES & set(found)
    assert "gateway_rate_limited" in found  # the counters stay, at 0 until something is refused


async def test_process_and_python_metrics_are_on_the_app_registry() -> None:
    async with sims(SimConfig()) as (engine,):
        settings = test_settings(worker_urls=(engine.url,))
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            assert (await chat(http, model=MODEL)).status_code == 200
            found = families((await http.get("/metrics")).text)
    for name in (
        "process_resident_memory_bytes",
        "process_cpu_seconds",
        "process_open_fds",
        "process_start_time_seconds",
        "python_info",
        "python_gc_objects_collected",
    ):
        assert name in found, name
    [(_, resident)] = found["process_resident_memory_bytes"]
    assert resident > 10 * 1024 * 1024
