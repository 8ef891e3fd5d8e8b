"""`--worker-dns` against a real DNS server: dnsmasq on a loopback port, simulated engines each on its own
loopback address (one port, as pods behind a headless Service), and the gateway app under uvicorn,
called through the official `openai` SDK. Every step waits on the app's own state (its fleet, its
discovery's lookup counts) with a bounded poll; the DNS records change between steps."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.mmap_dict import MmapedDict

from harmony_gateway.routing.dns_discovery import DnsDiscovery, worker_id
from harmony_gateway.routing.workers import WorkerKind
from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.dnsmasq import Dnsmasq, running_dnsmasq, wait_async
from tests.support.processes import free_port, start_gateway_process
from tests.support.servers import RunningGateway, running_gateway, test_settings, wait_until

NAME = "engines.test"
ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
ADMIN = {"authorization": "Bearer admin-key"}


@pytest.fixture
async def dns(tmp_path: Path) -> AsyncIterator[Dnsmasq]:
    async with running_dnsmasq(tmp_path) as server:
        yield server


@pytest.fixture
async def engines() -> AsyncIterator[list[RunningSim]]:
    """Engines on 127.0.0.2-4 and [::1], all on one port."""
    for _ in range(10):
        port = free_port()
        started: list[RunningSim] = []
        try:
            for host in (*ADDRESSES, "[::1]"):
                started.append(await start_sim_engine(SimConfig(host=host, port=port, model=MODEL)))
        except OSError:
            for sim in started:
                await sim.stop()
            continue
        try:
            yield started
        finally:
            for sim in started:
                await sim.stop()
        return
    raise RuntimeError("no port free on every loopback address")


def settings(dns: Dnsmasq, *targets: str, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "worker_dns": targets,
        "worker_dns_server": dns.server,
        "worker_dns_interval": 0.1,
        "worker_dns_timeout": 0.5,
        "admin_keys": frozenset({"admin-key"}),
    }
    return test_settings(**(options | overrides))


def hosts(*addresses: str) -> list[tuple[str, str]]:
    return [(address, NAME) for address in addresses]


def fleet_urls(gw: RunningGateway) -> set[str]:
    return {w.url for w in gw.state.fleet.all_workers()}


def serving_urls(gw: RunningGateway) -> set[str]:
    return {w.url for w in gw.state.fleet.all_workers() if w.available()}


def discovery(gw: RunningGateway) -> DnsDiscovery:
    found = gw.state.discovery
    assert found is not None
    return found


async def ask(gw: RunningGateway, text: str = "What is 2+2?") -> str:
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0, timeout=30) as client:
        completion = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}]
        )
    assert completion.choices[0].finish_reason == "stop"
    return completion.choices[0].message.content or ""


def served(engines: Sequence[RunningSim]) -> list[int]:
    return [len(sim.requests) for sim in engines]


@contextlib.asynccontextmanager
async def gateway(dns: Dnsmasq, *targets: str, **overrides: Any) -> AsyncIterator[RunningGateway]:
    async with running_gateway(settings(dns, *targets, **overrides)) as gw:
        yield gw


async def test_workers_come_and_go_with_the_records(dns: Dnsmasq, engines: list[RunningSim]) -> None:
    first, second, third, v6 = engines
    spec = f"grpc://{NAME}:{first.port}"
    await dns.set_hosts(hosts(ADDRESSES[0]))
    async with gateway(dns, spec) as gw, httpx.AsyncClient(base_url=gw.url, headers=ADMIN) as admin:
        # The first answer's worker was probed before the app served: it answers the first request.
        assert serving_urls(gw) == {first.url}
        assert await ask(gw)
        assert served(engines) == [1, 0, 0, 0]

        await dns.set_hosts(hosts(*ADDRESSES[:2]) + [("::1", NAME)])
        await wait_until(lambda: serving_urls(gw) == {first.url, second.url, v6.url})
        for _ in range(6):
            assert await ask(gw)
        assert served(engines)[0] >= 2 and all(served(engines)[i] >= 2 for i in (1, 3)), served(engines)

        listed = (await admin.get("/workers")).json()["data"]
        assert {(w["url"], w["id"], w["discovered_by"], w["draining"]) for w in listed} == {
            (sim.url, worker_id(WorkerKind.REGULAR, sim.url), spec, False) for sim in (first, second, v6)
        }
        refused = await admin.delete(f"/workers/{listed[0]['id']}")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "worker_discovered"
        metrics = (await admin.get("/metrics")).text
        assert f'gateway_dns_discovered_workers{{target="{spec}"}} 3.0' in metrics

        # A pod goes (unready, deleted): its address leaves the answer and the worker leaves the fleet.
        await dns.set_hosts(hosts(ADDRESSES[1]) + [("::1", NAME)])
        await wait_until(lambda: fleet_urls(gw) == {second.url, v6.url})
        before = served(engines)
        for _ in range(4):
            assert await ask(gw)
        after = served(engines)
        assert after[0] == before[0] and after[2] == before[2] == 0
        # The Service is deleted: NXDOMAIN; the fleet empties and the gateway is no longer ready.
        await dns.set_hosts([])
        await wait_until(lambda: not gw.state.fleet.workers)
        assert (await admin.get("/readiness")).status_code == 503
        # Scaled up again.
        await dns.set_hosts(hosts(ADDRESSES[2]))
        await wait_until(lambda: serving_urls(gw) == {third.url})
        assert await ask(gw)
        assert served(engines)[2] == 1


async def test_a_draining_worker_finishes_its_stream_and_takes_no_new_request(
    dns: Dnsmasq, engines: list[RunningSim]
) -> None:
    first, second = engines[:2]
    await dns.set_hosts(hosts(ADDRESSES[0]))
    async with (
        gateway(dns, f"grpc://{NAME}:{first.port}") as gw,
        openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0, timeout=60) as client,
    ):
        assert serving_urls(gw) == {first.url}
        leaving = next(iter(gw.state.fleet.all_workers()))
        first.hold()

        async def stream_answer() -> str:
            # The gateway answers once the engine's first token is there: held until released below.
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], stream=True
            )
            text = ""
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
            return text

        streaming = asyncio.create_task(stream_answer())
        await wait_until(lambda: first.active_requests == 1)
        await dns.set_hosts(hosts(ADDRESSES[1]))
        await wait_until(lambda: leaving.draining and second.url in serving_urls(gw))
        # New requests go to the worker that stays; the draining one keeps its stream.
        for _ in range(3):
            assert await ask(gw)
        assert served(engines)[:2] == [1, 3]
        assert leaving.id in gw.state.fleet.workers and leaving.in_flight == 1
        assert not streaming.done()
        first.release_held()
        assert await asyncio.wait_for(streaming, 30)
        await wait_until(lambda: leaving.id not in gw.state.fleet.workers)
        assert fleet_urls(gw) == {second.url}
        assert first.aborted == []


async def test_two_gateways_with_the_same_flags_reach_the_same_workers(
    dns: Dnsmasq, engines: list[RunningSim]
) -> None:
    spec = f"grpc://{NAME}:{engines[0].port}"
    await dns.set_hosts(hosts(*ADDRESSES[:2]))
    async with gateway(dns, spec) as one, gateway(dns, spec) as two:
        expected = {engines[0].url, engines[1].url}
        for gw in (one, two):
            await wait_until(lambda gw=gw: serving_urls(gw) == expected)
        assert set(one.state.fleet.workers) == set(two.state.fleet.workers)
        for wid, worker in one.state.fleet.workers.items():
            # Each replica holds its own engine connection (and KV-event subscription) per worker.
            assert two.state.fleet.workers[wid].client is not worker.client
        for gw in (one, two):
            for _ in range(2):
                assert await ask(gw)
        assert served(engines)[:2] == [2, 2]
        await dns.set_hosts(hosts(*ADDRESSES))
        for gw in (one, two):
            await wait_until(lambda gw=gw: serving_urls(gw) == {sim.url for sim in engines[:3]})
        assert set(one.state.fleet.workers) == set(two.state.fleet.workers)


async def test_a_resolver_outage_keeps_the_fleet(dns: Dnsmasq, engines: list[RunningSim]) -> None:
    spec = f"grpc://{NAME}:{engines[0].port}"
    await dns.set_hosts(hosts(*ADDRESSES[:2]))
    async with gateway(dns, spec, worker_dns_timeout=0.2) as gw:
        expected = {engines[0].url, engines[1].url}
        await wait_until(lambda: serving_urls(gw) == expected)
        dns.pause()  # every lookup times out
        failed = discovery(gw).failed_rounds
        await wait_until(lambda: discovery(gw).failed_rounds >= failed + 4)
        assert serving_urls(gw) == expected
        for _ in range(2):
            assert await ask(gw)
        body = gw.state.metrics.registry.get_sample_value(
            "gateway_dns_lookup_failures_total", {"target": spec, "reason": "timeout"}
        )
        assert body is not None and body >= 4
        dns.resume()
        # It answers again, and the answers count again: an address gone is drained.
        await dns.set_hosts(hosts(ADDRESSES[1]))
        await wait_until(lambda: fleet_urls(gw) == {engines[1].url})


async def test_srv_records_name_targets_and_ports(dns: Dnsmasq) -> None:
    srv = f"_grpc._tcp.{NAME}"
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(await start_sim_engine(SimConfig(port=0))) for _ in range(3)
        ]
        await dns.set_hosts([("127.0.0.1", f"e{i}.{NAME}") for i in range(3)])
        await dns.set_srv([(srv, f"e{i}.{NAME}", sim.port) for i, sim in enumerate(engines[:2])])
        async with gateway(dns, f"grpc+srv://{srv}") as gw:
            assert serving_urls(gw) == {engines[0].url, engines[1].url}
            assert await ask(gw)
            # dnsmasq restarts to read new SRV records: lookups fail meanwhile, and the fleet stays.
            await dns.set_srv([(srv, f"e{i}.{NAME}", sim.port) for i, sim in enumerate(engines)])
            await wait_until(lambda: serving_urls(gw) == {sim.url for sim in engines})
            await dns.set_srv([(srv, f"e2.{NAME}", engines[2].port)])
            await wait_until(lambda: fleet_urls(gw) == {engines[2].url})
            assert await ask(gw)
            assert len(engines[2].requests) == 1


async def test_a_large_answer_arrives_over_tcp(dns: Dnsmasq) -> None:
    """More addresses than a UDP answer holds (hundreds of pods): the resolver retries over TCP."""
    addresses = [f"10.1.{i // 250}.{i % 250 + 1}" for i in range(300)]
    await dns.set_hosts([(address, "many.test") for address in addresses])
    resolver = dns.resolver()

    async def answered() -> bool:
        return len(await resolver.addresses("many.test", "A")) == len(addresses)

    await wait_async(answered)
    assert {str(a) for a in await resolver.addresses("many.test", "A")} == set(addresses)


def healthy_ids_by_process(metrics_dir: Path) -> dict[int, set[str]]:
    """Per live gateway process: the worker ids its `gateway_worker_healthy` gauge file holds at 1."""
    out: dict[int, set[str]] = {}
    for path in metrics_dir.glob("gauge_livemax_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(str(path)):
            _metric, name, labels, _help = json.loads(key)
            if name == "gateway_worker_healthy":
                ids = out.setdefault(pid, set())
                if value == 1:
                    ids.add(labels["worker"])
    return out


@pytest.mark.timeout(150)
async def test_the_processes_of_serve_workers_each_resolve_and_name_workers_alike(
    dns: Dnsmasq, engines: list[RunningSim], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    first, second = engines[:2]
    await dns.set_hosts(hosts(*ADDRESSES[:2]))
    gw = await start_gateway_process(
        "--workers",
        "2",
        "--storage",
        f"sqlite:///{tmp_path / 'gateway.db'}",
        "--worker-dns",
        f"grpc://{NAME}:{first.port}",
        "--worker-dns-server",
        dns.server,
        "--worker-dns-interval",
        "0.2",
    )
    try:
        both = {worker_id(WorkerKind.REGULAR, sim.url) for sim in (first, second)}
        # Each process writes its fleet's gauges at every reconcile (about once a second).
        await wait_until(
            lambda: list(healthy_ids_by_process(metrics_dir).values()) == [both, both], timeout=30
        )
        # New connections each time: the kernel hands them to both processes.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{gw.port}", limits=limits, timeout=20
        ) as http:
            for _ in range(6):
                r = await http.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}]},
                )
                assert r.status_code == 200, r.text
        assert all(n > 0 for n in served(engines)[:2])
        await dns.set_hosts(hosts(ADDRESSES[1]))
        only = {worker_id(WorkerKind.REGULAR, second.url)}
        await wait_until(
            lambda: list(healthy_ids_by_process(metrics_dir).values()) == [only, only], timeout=30
        )
    finally:
        gw.stop()
