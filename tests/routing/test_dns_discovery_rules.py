"""DNS discovery's rules, round by round: a scripted resolver stands in for the DNS server (the real one,
dnsmasq, is in test_dns_discovery.py), the engines are real simulated ones on loopback addresses, and
each test drives the lookups itself (`refresh`), so what one answer does is checked before the next."""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
from anyio.abc import TaskGroup
from prometheus_client import CollectorRegistry

from harmony_gateway.engines.registry import GRPC_ENGINES, create_client
from harmony_gateway.errors import Conflict
from harmony_gateway.netguard import IPAddress, unusable_address
from harmony_gateway.routing.dns_discovery import (
    DnsDiscovery,
    DnsMetrics,
    LookupFailed,
    ServiceRecord,
    parse_dns_target,
    parse_nameserver,
    worker_id,
    worker_url,
)
from harmony_gateway.routing.fleet import Fleet
from harmony_gateway.routing.health import HealthChecker, HealthConfig
from harmony_gateway.routing.registry import create_policy
from harmony_gateway.routing.shared_registry import SharedWorkers, remove_worker
from harmony_gateway.routing.workers import Worker, WorkerKind
from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from harmony_gateway.storage import open_store
from tests.support.processes import free_port
from tests.support.servers import wait_until

NAME = "engines.test"
ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


@dataclass
class ScriptedResolver:
    """Answers from plain tables; `failing[(name, rdtype)]` makes that query fail with the reason."""

    a: dict[str, list[str]] = field(default_factory=dict)
    aaaa: dict[str, list[str]] = field(default_factory=dict)
    srv: dict[str, list[ServiceRecord]] = field(default_factory=dict)
    failing: dict[tuple[str, str], str] = field(default_factory=dict)
    #: Raise an error outside the resolver contract (a bug, not a DNS failure).
    crash: bool = False

    def _fail(self, name: str, rdtype: str) -> None:
        if self.crash:
            raise RuntimeError("resolver bug")
        reason = self.failing.get((name, rdtype))
        if reason is not None:
            raise LookupFailed(name, reason, "scripted")

    async def addresses(self, name: str, rdtype: Literal["A", "AAAA"]) -> list[IPAddress]:
        self._fail(name, rdtype)
        table = self.a if rdtype == "A" else self.aaaa
        return [ipaddress.ip_address(a) for a in table.get(name, [])]

    async def services(self, name: str) -> list[ServiceRecord]:
        self._fail(name, "SRV")
        return list(self.srv.get(name, []))


@pytest.fixture
async def engines() -> AsyncIterator[list[RunningSim]]:
    """Three engines on one port, each on its own loopback address, as pods behind one Service."""
    for _ in range(10):
        port = free_port()
        started: list[RunningSim] = []
        try:
            for host in ADDRESSES:
                started.append(await start_sim_engine(SimConfig(host=host, port=port)))
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


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    fleet = Fleet(
        client_factory=lambda url, engine: create_client(url, engine),
        policy_factory=lambda model, role: create_policy("round_robin"),
        connect_timeout=2.0,
        health_timeout=1.0,
    )
    try:
        yield fleet
    finally:
        await fleet.close()


@contextlib.asynccontextmanager
async def discovering(
    fleet: Fleet, resolver: ScriptedResolver, *specs: str, **options: Any
) -> AsyncIterator[tuple[DnsDiscovery, TaskGroup]]:
    targets = [parse_dns_target(spec, tuple(GRPC_ENGINES)) for spec in specs]
    discovery = DnsDiscovery(fleet, targets, resolver, **options)
    async with anyio.create_task_group() as tg:
        yield discovery, tg
        tg.cancel_scope.cancel()


async def look_up(discovery: DnsDiscovery, tg: TaskGroup) -> None:
    """One round, and the admissions it started, done."""
    for member in await discovery.refresh(tg):
        await member.admitted.wait()


def urls(fleet: Fleet) -> set[str]:
    return {w.url for w in fleet.all_workers()}


def by_url(fleet: Fleet, url: str) -> Worker:
    return next(w for w in fleet.all_workers() if w.url == url)


def url_of(sim: RunningSim) -> str:
    return sim.url


# -- parsing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "name", "port", "scheme", "kind", "engine"),
    [
        (
            "grpc://engines.ns.svc.cluster.local:30000",
            "engines.ns.svc.cluster.local",
            30000,
            "grpc",
            "regular",
            None,
        ),
        ("grpcs://engines:443?kind=decode", "engines", 443, "grpcs", "decode", None),
        (
            "grpc+srv://_grpc._tcp.engines.ns.svc.cluster.local",
            "_grpc._tcp.engines.ns.svc.cluster.local",
            None,
            "grpc",
            "regular",
            None,
        ),
        (
            "grpcs+srv://_grpc._tcp.e.test.?kind=prefill&engine=vllm",
            "_grpc._tcp.e.test.",
            None,
            "grpcs",
            "prefill",
            "vllm",
        ),
    ],
)
def test_targets_parse(
    spec: str, name: str, port: int | None, scheme: str, kind: str, engine: str | None
) -> None:
    target = parse_dns_target(spec, tuple(GRPC_ENGINES))
    assert (target.name, target.port, target.scheme, target.kind.value, target.engine) == (
        name,
        port,
        scheme,
        kind,
        engine,
    )
    assert target.srv is (port is None)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("http://engines:80", "expected grpc://NAME:PORT"),
        ("grpc://engines", "needs a port"),
        ("grpc+srv://_grpc._tcp.engines:30000", "drop :30000"),
        ("grpc://10.0.0.1:30000", "use --worker-url"),
        ("grpc://engines:30000?kind=big", "unknown kind 'big'"),
        ("grpc://engines:30000?engine=nope", "unknown engine 'nope'"),
        ("grpc://engines:30000?weight=2", "unknown option 'weight'"),
        ("grpc://user:pw@engines:30000", "no credentials"),
        ("grpc://engines:30000/path", "expected grpc://NAME:PORT"),
        ("grpc://engines:99999", "not a URL"),
    ],
)
def test_malformed_targets_are_named(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="--worker-dns") as info:
        parse_dns_target(spec, tuple(GRPC_ENGINES))
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("10.0.0.10", ("10.0.0.10", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("::1", ("::1", 53)),
        ("[::1]:5353", ("::1", 5353)),
        ("[fd00::a]", ("fd00::a", 53)),
    ],
)
def test_nameservers_parse(value: str, expected: tuple[str, int]) -> None:
    assert parse_nameserver(value) == expected


@pytest.mark.parametrize("value", ["dns.example", "127.0.0.1:0", "127.0.0.1:x", "[::1", "[::1]x"])
def test_malformed_nameservers_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match="--worker-dns-server"):
        parse_nameserver(value)


def test_worker_urls_and_ids() -> None:
    assert worker_url("grpc", ipaddress.ip_address("10.0.0.3"), 30000) == "grpc://10.0.0.3:30000"
    assert worker_url("grpcs", ipaddress.ip_address("fd00::3"), 30000) == "grpcs://[fd00::3]:30000"
    url = "grpc://10.0.0.3:30000"
    # The same in every replica: made from the kind and URL only.
    assert worker_id(WorkerKind.REGULAR, url) == worker_id(WorkerKind.REGULAR, url)
    assert worker_id(WorkerKind.REGULAR, url) != worker_id(WorkerKind.DECODE, url)
    assert worker_id(WorkerKind.REGULAR, url).startswith("dns-")


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("169.254.169.254", True),
        ("fe80::1", True),
        ("::ffff:169.254.169.254", True),
        ("224.0.0.1", True),
        ("0.0.0.0", True),
        ("240.0.0.1", True),
        ("10.1.2.3", False),
        ("127.0.0.2", False),
        ("::1", False),
        ("255.255.255.255", True),
        ("fd00::3", False),
        ("8.8.8.8", False),
        ("fd00:ec2::254", True),
        ("100.100.100.200", True),
    ],
)
def test_addresses_that_can_never_be_engines(address: str, refused: bool) -> None:
    assert (unusable_address(ipaddress.ip_address(address)) is not None) is refused


# -- rounds ---------------------------------------------------------------------------------------------


async def test_new_addresses_are_admitted_under_ids_every_replica_shares(
    engines: list[RunningSim], fleet: Fleet
) -> None:
    port = engines[0].port
    resolver = ScriptedResolver(a={NAME: list(ADDRESSES[:2])})
    spec = f"grpc://{NAME}:{port}?engine=sglang"
    async with discovering(fleet, resolver, spec) as (discovery, tg):
        await look_up(discovery, tg)
        assert urls(fleet) == {engines[0].url, engines[1].url}
        for worker in fleet.all_workers():
            assert worker.healthy and worker.model_id and worker.engine == "sglang"
            assert worker.id == worker_id(WorkerKind.REGULAR, worker.url)
            assert worker.discovered_by == spec
        resolver.a[NAME].append(ADDRESSES[2])
        await look_up(discovery, tg)
        assert urls(fleet) == {sim.url for sim in engines}
        assert fleet.ready()


async def test_an_address_drains_once_missing_from_two_answers_in_a_row(
    engines: list[RunningSim], fleet: Fleet
) -> None:
    resolver = ScriptedResolver(a={NAME: list(ADDRESSES)})
    async with discovering(fleet, resolver, f"grpc://{NAME}:{engines[0].port}") as (discovery, tg):
        await look_up(discovery, tg)
        gone = by_url(fleet, engines[2].url)
        resolver.a[NAME] = list(ADDRESSES[:2])
        await look_up(discovery, tg)
        # One odd answer drains nothing.
        assert engines[2].url in discovery.listed(discovery.targets[0])
        assert not gone.draining and gone.available() and engines[2].url in urls(fleet)
        resolver.a[NAME] = list(ADDRESSES)
        await look_up(discovery, tg)
        resolver.a[NAME] = list(ADDRESSES[:2])
        await look_up(discovery, tg)
        assert not gone.draining  # the count starts again after it was listed
        await look_up(discovery, tg)
        await wait_until(lambda: engines[2].url not in urls(fleet))
        assert urls(fleet) == {engines[0].url, engines[1].url}


async def test_an_empty_answer_or_nxdomain_drains_everything_after_two(
    engines: list[RunningSim], fleet: Fleet
) -> None:
    resolver = ScriptedResolver(a={NAME: list(ADDRESSES[:2])})
    async with discovering(fleet, resolver, f"grpc://{NAME}:{engines[0].port}") as (discovery, tg):
        await look_up(discovery, tg)
        resolver.a.clear()  # the name is gone: NXDOMAIN, an empty list
        await look_up(discovery, tg)
        assert len(discovery.listed(discovery.targets[0])) == 2
        assert len(fleet.workers) == 2 and not any(w.draining for w in fleet.all_workers())
        await look_up(discovery, tg)
        await wait_until(lambda: not fleet.workers)
        assert not fleet.groups and not fleet.ready()


async def test_failed_lookups_keep_the_fleet_and_a_partial_one_only_adds(
    engines: list[RunningSim], fleet: Fleet
) -> None:
    resolver = ScriptedResolver(a={NAME: list(ADDRESSES[:2])})
    metrics = DnsMetrics(CollectorRegistry())
    spec = f"grpc://{NAME}:{engines[0].port}"
    async with discovering(fleet, resolver, spec, metrics=metrics) as (discovery, tg):
        await look_up(discovery, tg)
        before = set(fleet.workers)
        resolver.failing = {(NAME, "A"): "timeout", (NAME, "AAAA"): "timeout"}
        for _ in range(4):
            await look_up(discovery, tg)
        assert set(fleet.workers) == before and not any(w.draining for w in fleet.all_workers())
        assert len(discovery.listed(discovery.targets[0])) == 2
        assert discovery.failed_rounds == 4
        assert (
            metrics.registry.get_sample_value(
                "gateway_dns_lookup_failures_total", {"target": spec, "reason": "timeout"}
            )
            == 4
        )
        # AAAA fails (a SERVFAIL), A answers with one address gone and one new: the new one is added,
        # nothing is drained however often it happens.
        resolver.failing = {(NAME, "AAAA"): "servfail"}
        resolver.a[NAME] = [ADDRESSES[1], ADDRESSES[2]]
        for _ in range(3):
            await look_up(discovery, tg)
        assert urls(fleet) == {sim.url for sim in engines}
        assert not any(w.draining for w in fleet.all_workers())
        assert metrics.registry.get_sample_value("gateway_dns_discovered_workers", {"target": spec}) == 3
        # Whole answers again: the missing address drains after two of them.
        resolver.failing = {}
        await look_up(discovery, tg)
        await look_up(discovery, tg)
        await wait_until(lambda: engines[0].url not in urls(fleet))
        assert metrics.registry.get_sample_value("gateway_dns_discovered_workers", {"target": spec}) == 2


async def test_the_loop_answers_once_the_first_workers_are_in_and_survives_a_resolver_fault(
    engines: list[RunningSim], fleet: Fleet
) -> None:
    resolver = ScriptedResolver(a={NAME: [ADDRESSES[0]]})
    async with discovering(fleet, resolver, f"grpc://{NAME}:{engines[0].port}", interval=0.05) as (
        discovery,
        tg,
    ):
        await tg.start(discovery.run)
        assert {w.url for w in fleet.all_workers() if w.available()} == {engines[0].url}
        resolver.crash = True
        rounds = discovery.failed_rounds
        await wait_until(lambda: discovery.failed_rounds >= rounds + 3)
        assert urls(fleet) == {engines[0].url}
        resolver.crash = False
        resolver.a[NAME] = [ADDRESSES[1]]
        await wait_until(lambda: urls(fleet) == {engines[1].url})


async def test_a_draining_worker_takes_no_request_and_leaves_when_its_last_one_ends(
    engines: list[RunningSim], fleet: Fleet
) -> None:
    resolver = ScriptedResolver(a={NAME: list(ADDRESSES[:2])})
    async with discovering(fleet, resolver, f"grpc://{NAME}:{engines[0].port}") as (discovery, tg):
        await look_up(discovery, tg)
        worker = by_url(fleet, engines[0].url)
        worker.in_flight = 1  # a request the pipeline has on it
        resolver.a[NAME] = [ADDRESSES[1]]
        await look_up(discovery, tg)
        await look_up(discovery, tg)
        await wait_until(lambda: worker.draining)
        assert not worker.available() and worker.id in fleet.workers
        group = fleet.groups[worker.model_id]
        assert worker in group.workers and group.has_available_worker()
        # Back in DNS while draining: the drain stops, the worker serves again.
        resolver.a[NAME] = list(ADDRESSES[:2])
        await look_up(discovery, tg)
        await wait_until(lambda: not worker.draining)
        assert worker.available()
        resolver.a[NAME] = [ADDRESSES[1]]
        await look_up(discovery, tg)
        await look_up(discovery, tg)
        await wait_until(lambda: worker.draining)
        worker.in_flight = 0  # the request ended
        await wait_until(lambda: worker.id not in fleet.workers)
        assert worker not in group.workers


async def test_the_drain_bound_removes_a_worker_with_requests_still_running(
    engines: list[RunningSim], fleet: Fleet
) -> None:
    resolver = ScriptedResolver(a={NAME: [ADDRESSES[0]]})
    options = {"drain_timeout": 0.2}
    async with discovering(fleet, resolver, f"grpc://{NAME}:{engines[0].port}", **options) as (discovery, tg):
        await look_up(discovery, tg)
        worker = by_url(fleet, engines[0].url)
        worker.in_flight = 1  # never ends
        resolver.a[NAME] = []
        await look_up(discovery, tg)
        await look_up(discovery, tg)
        await wait_until(lambda: worker.id not in fleet.workers)


async def test_addresses_that_can_never_be_engines_are_refused(
    engines: list[RunningSim], fleet: Fleet
) -> None:
    resolver = ScriptedResolver(
        a={NAME: ["169.254.169.254", ADDRESSES[0], "224.0.0.1"]}, aaaa={NAME: ["fe80::1"]}
    )
    async with discovering(fleet, resolver, f"grpc://{NAME}:{engines[0].port}") as (discovery, tg):
        await look_up(discovery, tg)
        await look_up(discovery, tg)
        assert urls(fleet) == {engines[0].url}


async def test_a_worker_from_the_command_line_stays_the_command_lines(
    engines: list[RunningSim], fleet: Fleet
) -> None:
    static = await fleet.admit(engines[0].url)
    resolver = ScriptedResolver(a={NAME: list(ADDRESSES[:2])})
    async with discovering(fleet, resolver, f"grpc://{NAME}:{engines[0].port}") as (discovery, tg):
        await look_up(discovery, tg)
        assert urls(fleet) == {engines[0].url, engines[1].url}
        assert fleet.workers[static.id] is static and static.discovered_by is None
        resolver.a[NAME] = []
        for _ in range(3):
            await look_up(discovery, tg)
        await wait_until(lambda: urls(fleet) == {engines[0].url})
        assert not static.draining


async def test_srv_records_give_targets_and_ports(fleet: Fleet) -> None:
    async with (
        await start_sim_engine(SimConfig(port=0)) as first,
        await start_sim_engine(SimConfig(port=0)) as second,
    ):
        name = f"_grpc._tcp.{NAME}"
        resolver = ScriptedResolver(
            srv={
                name: [
                    ServiceRecord("e1.test.", first.port),
                    ServiceRecord("e2.test.", second.port),
                    ServiceRecord(".", 1),  # "not offered here"
                ]
            },
            a={"e1.test.": ["127.0.0.1"], "e2.test.": ["127.0.0.1"]},
        )
        async with discovering(fleet, resolver, f"grpc+srv://{name}?kind=regular") as (discovery, tg):
            await look_up(discovery, tg)
            assert urls(fleet) == {first.url, second.url}
            # One target's addresses fail to resolve: kept; the SRV answer itself fails: all kept.
            resolver.failing = {("e2.test.", "A"): "timeout"}
            await look_up(discovery, tg)
            await look_up(discovery, tg)
            resolver.failing = {(name, "SRV"): "servfail"}
            await look_up(discovery, tg)
            await look_up(discovery, tg)
            assert urls(fleet) == {first.url, second.url}
            resolver.failing = {}
            resolver.srv[name] = resolver.srv[name][:1]
            await look_up(discovery, tg)
            await look_up(discovery, tg)
            await wait_until(lambda: urls(fleet) == {first.url})


async def test_a_discovered_worker_cannot_be_deleted_through_the_api(
    engines: list[RunningSim], fleet: Fleet
) -> None:
    resolver = ScriptedResolver(a={NAME: [ADDRESSES[0]]})
    async with discovering(fleet, resolver, f"grpc://{NAME}:{engines[0].port}") as (discovery, tg):
        await look_up(discovery, tg)
        (worker,) = fleet.all_workers()
        with pytest.raises(Conflict) as info:
            await remove_worker(fleet, worker.id)
        assert info.value.code == "worker_discovered"
        assert worker.id in fleet.workers


async def test_the_shared_registry_of_serve_workers_leaves_discovered_workers_alone(
    engines: list[RunningSim], fleet: Fleet, tmp_path: Path
) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'gw.db'}")
    await store.start()
    try:
        checker = HealthChecker(fleet.all_workers, HealthConfig(interval=0.1, timeout=0.5))
        shared = SharedWorkers(fleet, store, checker, fleet.admit, "p1", interval=0.1, lease_ttl=60.0)
        await shared.start()
        resolver = ScriptedResolver(a={NAME: [ADDRESSES[0]]})
        async with discovering(fleet, resolver, f"grpc://{NAME}:{engines[0].port}") as (discovery, tg):
            await look_up(discovery, tg)
            (worker,) = fleet.all_workers()
            await shared.sync()
            await shared.sync()
            assert fleet.workers == {worker.id: worker}
            with pytest.raises(Conflict):
                await remove_worker(fleet, worker.id)
        await shared.close()
    finally:
        await store.close()
