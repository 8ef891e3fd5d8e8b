"""`/metrics` end to end: Prometheus text that moves with traffic, retries and worker state."""

from __future__ import annotations

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from harmony_gateway.sim import SimConfig
from tests.conftest import MODEL
from tests.e2e._fleet import chat, sims
from tests.support.servers import running_gateway
from tests.support.servers import test_settings as gateway_settings


async def scrape(http: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = await http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_move_with_traffic() -> None:
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(worker_urls=tuple(e.url for e in engines), health_interval=0.2)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            before = await scrape(http)
            assert (await chat(http)).status_code == 200
            assert (await chat(http, stream=True)).status_code == 200
            assert (await chat(http, model="no-such-model")).status_code == 404
            # One of the next two requests tries the armed worker first and is retried on the other.
            engines[0].fail_next(grpc.StatusCode.UNAVAILABLE)
            assert (await chat(http)).status_code == 200
            assert (await chat(http)).status_code == 200
            after = await scrape(http)

    ok = value(after, "gateway_requests_total", route="chat", model=MODEL, status="200")
    assert ok - value(before, "gateway_requests_total", route="chat", model=MODEL, status="200") == 4
    assert value(after, "gateway_requests_total", route="chat", model="unknown", status="404") == 1
    assert value(after, "gateway_request_duration_seconds_count", route="chat", model=MODEL) == 4
    assert value(after, "gateway_time_to_first_token_seconds_count", route="chat", model=MODEL) == 4
    assert value(after, "gateway_inter_token_latency_seconds_count", route="chat", model=MODEL) == 4
    assert value(after, "gateway_prompt_tokens_total", model=MODEL) > 0
    # The streamed request asked for no usage; its completion tokens are counted anyway.
    assert value(after, "gateway_completion_tokens_total", model=MODEL) > 4 * 10
    assert value(after, "gateway_retries_total", model=MODEL) == 1
    assert value(after, "gateway_harmony_requests_total") == 4
    assert value(after, "gateway_harmony_parsing_errors_total") == 0
    assert value(after, "gateway_harmony_channel_messages_total", channel="analysis") == 4
    assert value(after, "gateway_harmony_channel_messages_total", channel="final") == 4
    for sim in engines:
        wid = next(k for k in after if k[0] == "gateway_worker_healthy" and ("url", sim.url) in k[1])
        labels = dict(wid[1])
        assert after[wid] == 1.0 and labels["kind"] == "regular" and labels["model"] == MODEL
        assert value(after, "gateway_worker_in_flight", **labels) == 0
        breaker = {"worker": labels["worker"], "url": sim.url}
        assert value(after, "gateway_worker_circuit_breaker_state", state="closed", **breaker) == 1
        assert value(after, "gateway_worker_circuit_breaker_state", state="open", **breaker) == 0


async def test_worker_gauges_are_read_at_scrape_time() -> None:
    async with sims(SimConfig(tokens_per_second=40)) as (engine,):
        settings = gateway_settings(
            worker_urls=(engine.url,), health_interval=0.2, health_failure_threshold=1
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            async with http.stream(
                "POST",
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
            ) as r:
                async for _ in r.aiter_lines():
                    break  # first bytes arrived: the request is in flight
                samples = await scrape(http)
                (in_flight,) = [v for k, v in samples.items() if k[0] == "gateway_worker_in_flight"]
                assert in_flight == 1
            await engine.set_healthy(False)
            worker = gw.state.fleet.all_workers()[0]
            from tests.support.servers import wait_until

            await wait_until(lambda: not worker.healthy, timeout=5)
            samples = await scrape(http)
            assert [v for k, v in samples.items() if k[0] == "gateway_worker_healthy"] == [0.0]


def test_two_apps_have_separate_registries() -> None:
    from harmony_gateway.observability.metrics import GatewayMetrics

    a, b = GatewayMetrics(), GatewayMetrics()
    a.retries.labels(model="m").inc()
    assert b'gateway_retries_total{model="m"} 1.0' in a.render()[0]
    assert b'model="m"' not in b.render()[0]


async def test_harmony_parsing_errors_are_counted() -> None:
    async with sims(SimConfig()) as (engine,):
        settings = gateway_settings(worker_urls=(engine.url,), health_interval=0.2)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            r = await chat(http, "[[junk]] please")
            assert r.status_code == 502
            r = await chat(http, "[[preamble]] hello", stream=True)
            assert r.status_code == 200
            samples = await scrape(http)
    assert value(samples, "gateway_harmony_parsing_errors_total") == 1
    assert value(samples, "gateway_harmony_requests_total") == 2
    assert value(samples, "gateway_harmony_channel_messages_total", channel="commentary") == 1
    assert value(samples, "gateway_requests_total", route="chat", model=MODEL, status="502") == 1
