"""Workers found through DNS (`--worker-dns`): each target is looked up again every few seconds, and
the fleet follows its answers through its usual join and leave paths (`Fleet.admit`, `Fleet.remove`).

A target is a URL naming a DNS name and how its answers become workers:

- `grpc://NAME:PORT`: the A and AAAA records of NAME; one worker per address, `grpc://ADDRESS:PORT`
  (an IPv6 address in brackets). A Kubernetes headless Service answers with its ready pods' addresses.
- `grpc+srv://NAME`: the SRV records of NAME (e.g. `_grpc._tcp.engines.ns.svc.cluster.local`); one
  worker per address of each record's target, on that record's port. Every target is a worker:
  priority and weight are not read (Kubernetes gives all the same); a target of "." is none.
- `grpcs://` and `grpcs+srv://` give `grpcs://` workers; `?kind=prefill|decode` and `?engine=NAME` set
  the workers' kind and gRPC protocol (default: regular, and `--engine`).

Answers and failures:

- A new address is admitted at once (probed, then routed to once healthy).
- An address is drained once it was missing from `MISSING_LOOKUPS` (2) answers in a row: it takes no
  new request, and leaves the fleet once its requests in flight finish, or after the drain bound
  (`--worker-dns-drain-timeout`; then what still runs is cut). An address that comes back while its
  worker drains stops the drain. An empty answer and NXDOMAIN are answers too: a name that vanishes
  drains its workers after two lookups, one interval apart, and a single odd answer drains nothing.
- A lookup that fails (timeout, SERVFAIL or REFUSED, no server reachable) is no answer: the target
  keeps the workers it had, the failure is counted and logged at the 1st, 2nd, 4th, 8th... failure in
  a row, and a line says when it answers again. When only part of a lookup fails (AAAA but not A, one
  SRV target's addresses), what was found is added and nothing is drained.
- Addresses that can never be an engine are refused whatever an answer says (`netguard.unusable_address`):
  link-local ones (169.254.0.0/16 holds the cloud metadata service; fe80::/10 needs an interface), the
  other cloud metadata addresses, multicast, unspecified and IPv4 reserved (240.0.0.0/4, broadcast).
  Private and loopback addresses are what a cluster's DNS returns, and the name is the operator's own
  flag, so `--worker-allow-hosts`, which narrows the worker API (url_policy.py), does not apply.

Replicas: a worker's id comes from its kind and URL (`dns-<hex>`), so every gateway replica, and each
process of `serve --workers N`, that resolves the same name holds the same workers under the same ids
(their metrics add up across processes). Each resolves on its own (DNS is the state they share) and
holds its own engine connections and KV-event subscriptions; nothing about them goes through storage.
The worker API cannot delete a discovered worker (409 `worker_discovered`): DNS would bring it back.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol
from urllib.parse import parse_qsl, urlsplit

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ..errors import GatewayError, NotFound
from ..netguard import IPAddress, unusable_address
from ..observability.metrics import MetricSet, counter, gauge
from .fleet import Fleet
from .workers import Worker, WorkerKind

log = logging.getLogger(__name__)

#: Answers in a row an address must be missing from before its worker drains.
MISSING_LOOKUPS = 2
DEFAULT_INTERVAL = 5.0
DEFAULT_TIMEOUT = 2.0
#: How often a draining worker's in-flight count is read.
DRAIN_POLL = 0.1

#: Target URL scheme → (worker URL scheme, SRV lookup).
_SCHEMES = {
    "grpc": ("grpc", False),
    "grpcs": ("grpcs", False),
    "grpc+srv": ("grpc", True),
    "grpcs+srv": ("grpcs", True),
}
_FORMS = "grpc://NAME:PORT or grpc+srv://NAME (grpcs too), optionally ?kind=KIND&engine=ENGINE"


@dataclass(frozen=True, slots=True)
class DnsTarget:
    """One `--worker-dns` URL, parsed (`parse_dns_target`). `port` is None for an SRV target."""

    spec: str
    scheme: str
    name: str
    port: int | None
    kind: WorkerKind = WorkerKind.REGULAR
    engine: str | None = None

    @property
    def srv(self) -> bool:
        return self.port is None


def parse_dns_target(spec: str, engines: Sequence[str] = ()) -> DnsTarget:
    """The target a `--worker-dns` URL names; ValueError with a one-line reason when it is malformed.
    `engines`: the accepted `?engine=` values (not checked when empty).

    >>> parse_dns_target("grpc+srv://_grpc._tcp.engines.ns.svc.cluster.local?kind=prefill").kind
    <WorkerKind.PREFILL: 'prefill'>
    """
    problem = f"--worker-dns {spec!r}"
    try:
        parts = urlsplit(spec)
        port = parts.port
    except ValueError:
        raise ValueError(f"{problem} is not a URL; expected {_FORMS}") from None
    form = _SCHEMES.get(parts.scheme)
    name = parts.hostname
    if form is None or not name or parts.path not in ("", "/") or parts.fragment:
        raise ValueError(f"{problem}: expected {_FORMS}")
    if "@" in parts.netloc:
        raise ValueError(f"{problem}: a gRPC target carries no credentials")
    try:
        ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        raise ValueError(f"{problem} names an address, not a DNS name: use --worker-url")
    scheme, srv = form
    if srv and port is not None:
        raise ValueError(f"{problem}: an SRV target takes its ports from the records; drop :{port}")
    if not srv and port is None:
        raise ValueError(f"{problem} needs a port: {parts.scheme}://{name}:PORT")
    kind = WorkerKind.REGULAR
    engine = None
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key == "kind":
            try:
                kind = WorkerKind(value)
            except ValueError:
                kinds = ", ".join(k.value for k in WorkerKind)
                raise ValueError(f"{problem}: unknown kind {value!r}; expected one of {kinds}") from None
        elif key == "engine":
            if engines and value not in engines:
                raise ValueError(f"{problem}: unknown engine {value!r}; expected one of {', '.join(engines)}")
            engine = value
        else:
            raise ValueError(f"{problem}: unknown option {key!r}; expected kind or engine")
    return DnsTarget(spec=spec, scheme=scheme, name=name, port=port, kind=kind, engine=engine)


def parse_nameserver(value: str) -> tuple[str, int]:
    """`--worker-dns-server`: an address with an optional port (`10.0.0.10`, `127.0.0.1:5353`, `::1`,
    `[::1]:5353`); the port defaults to 53. ValueError when it is no address."""
    host, port = value, "53"
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"--worker-dns-server {value!r}: expected [ADDRESS]:PORT")
        port = rest[1:] or "53"
    elif value.count(":") == 1:
        host, port = value.split(":")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"--worker-dns-server {value!r}: expected an IP address, with :PORT if not 53"
        ) from None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--worker-dns-server {value!r}: bad port {port!r}")
    return str(address), int(port)


def worker_url(scheme: str, address: IPAddress, port: int) -> str:
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"{scheme}://{host}:{port}"


def worker_id(kind: WorkerKind, url: str) -> str:
    """The id of a discovered worker: the same in every replica and process that finds it."""
    return "dns-" + hashlib.sha256(f"{kind.value} {url}".encode()).hexdigest()[:12]


class LookupFailed(Exception):
    """Raised by a `Resolver` when a query got no answer: `reason` is `timeout`, `servfail` (the
    server answered SERVFAIL or REFUSED, or none could be reached) or `error`. NXDOMAIN and an empty
    answer are answers, not failures."""

    def __init__(self, name: str, reason: str, detail: str = "") -> None:
        super().__init__(f"{name}: {reason}{': ' + detail if detail else ''}")
        self.name = name
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class ServiceRecord:
    target: str
    port: int


class Resolver(Protocol):
    """The DNS queries discovery makes; each is bounded by the resolver's own timeout. Both return
    an empty list for NXDOMAIN or a name without records of the type, and raise LookupFailed when no
    answer came (`dns_resolver.DnsResolver` asks a real server)."""

    async def addresses(self, name: str, rdtype: Literal["A", "AAAA"]) -> list[IPAddress]: ...

    async def services(self, name: str) -> list[ServiceRecord]: ...


class DnsMetrics(MetricSet):
    """Discovery metrics, on the app's `GatewayMetrics` registry."""

    discovered = gauge(
        "gateway_dns_discovered_workers",
        "Worker addresses a --worker-dns target holds: its latest answer, with what failed lookups kept",
        ["target"],
        multiprocess_mode="livemax",
    )
    lookup_failures = counter(
        "gateway_dns_lookup_failures_total",
        "Lookups of a --worker-dns target that failed in all or part, by reason (timeout, servfail, error)",
        ["target", "reason"],
    )


@dataclass(slots=True)
class _Answer:
    """One lookup of a target: the addresses and ports found, and the first failure when a query failed."""

    endpoints: set[tuple[IPAddress, int]] = field(default_factory=set)
    failure: LookupFailed | None = None
    #: Nothing was found because everything failed (rather than part).
    failed_whole: bool = False


@dataclass(eq=False, slots=True)
class _TargetState:
    target: DnsTarget
    #: Worker URL → answers in a row it was missing from.
    listed: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    #: Addresses refused (`unusable_address`), each logged once.
    refused: set[IPAddress] = field(default_factory=set)


@dataclass(eq=False)
class _Member:
    """A discovered worker's life, kept by one task: admitted, then drained once DNS lets it go."""

    kind: WorkerKind
    url: str
    target: DnsTarget
    wanted: bool = True
    changed: anyio.Event = field(default_factory=anyio.Event)
    admitted: anyio.Event = field(default_factory=anyio.Event)

    def want(self, wanted: bool) -> None:
        if wanted != self.wanted:
            self.wanted = wanted
            self.changed.set()
            self.changed = anyio.Event()


class DnsDiscovery:
    """Keeps the fleet in step with the `targets`' DNS answers (see the module docstring).

    `run()` belongs in the app's lifespan task group, started with `tg.start`: it answers once the first
    lookup's workers were admitted (probed), so they serve from the first request, and then looks up
    every `interval` seconds until cancelled. `rounds` and `failed_rounds` count the lookups made and
    those that failed in all or part, for whoever waits on them.
    """

    def __init__(
        self,
        fleet: Fleet,
        targets: Sequence[DnsTarget],
        resolver: Resolver,
        *,
        interval: float = DEFAULT_INTERVAL,
        drain_timeout: float = 1800.0,
        metrics: DnsMetrics | None = None,
        missing_lookups: int = MISSING_LOOKUPS,
    ) -> None:
        if interval <= 0 or drain_timeout < 0 or missing_lookups < 1:
            raise ValueError("interval must be above 0, drain_timeout 0 or more, missing_lookups 1 or more")
        self.fleet = fleet
        self.resolver = resolver
        self.interval = interval
        self.drain_timeout = drain_timeout
        self.metrics = metrics
        self.missing_lookups = missing_lookups
        self.rounds = 0
        self.failed_rounds = 0
        self._targets = [_TargetState(t) for t in targets]
        self._members: dict[tuple[WorkerKind, str], _Member] = {}

    @property
    def targets(self) -> list[DnsTarget]:
        return [state.target for state in self._targets]

    def listed(self, target: DnsTarget) -> set[str]:
        """The worker URLs `target` holds now."""
        return {url for state in self._targets if state.target == target for url in state.listed}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            started = anyio.current_time()
            for member in await self._round(tg):
                await member.admitted.wait()
            task_status.started()
            while True:
                await anyio.sleep(max(0.0, self.interval - (anyio.current_time() - started)))
                started = anyio.current_time()
                await self._round(tg)

    async def _round(self, tg: TaskGroup) -> list[_Member]:
        try:
            return await self.refresh(tg)
        except Exception:  # a fault here must not stop discovery, nor the app whose task group it is in
            log.exception("DNS discovery round failed")
            return []

    # -- one round -------------------------------------------------------------------------------
    async def refresh(self, tg: TaskGroup) -> list[_Member]:
        """Look every target up once and start the changes their answers call for (admissions and
        drains run in `tg`); returns the members it started."""
        answers: list[_Answer] = [_Answer() for _ in self._targets]

        async def look_up(i: int) -> None:
            target = self._targets[i].target
            try:
                answers[i] = await self._look_up(target)
            except Exception as exc:  # a resolver fault outside its contract: a failed lookup all the same
                log.exception("DNS lookup of %s failed unexpectedly", target.spec)
                failure = LookupFailed(target.name, "error", f"{type(exc).__name__}: {exc}")
                answers[i] = _Answer(failure=failure, failed_whole=True)

        async with anyio.create_task_group() as lookups:
            for i in range(len(self._targets)):
                lookups.start_soon(look_up, i)
        failed = False
        for state, answer in zip(self._targets, answers, strict=True):
            failed |= answer.failure is not None
            self._apply(state, answer)
        self.rounds += 1
        self.failed_rounds += failed
        return self._reconcile(tg)

    async def _look_up(self, target: DnsTarget) -> _Answer:
        answer = _Answer()
        if target.srv:
            try:
                records = await self.resolver.services(target.name)
            except LookupFailed as exc:
                return _Answer(failure=exc, failed_whole=True)
            hosts = [(r.target, r.port) for r in records if r.target.rstrip(".")]
        else:
            assert target.port is not None
            hosts = [(target.name, target.port)]
        results: list[tuple[int, list[IPAddress] | LookupFailed]] = []

        async def addresses(name: str, port: int, rdtype: Literal["A", "AAAA"]) -> None:
            try:
                results.append((port, await self.resolver.addresses(name, rdtype)))
            except LookupFailed as exc:
                results.append((port, exc))

        async with anyio.create_task_group() as tg:
            for name, port in hosts:
                tg.start_soon(addresses, name, port, "A")
                tg.start_soon(addresses, name, port, "AAAA")
        for port, found in results:
            if isinstance(found, LookupFailed):
                answer.failure = answer.failure or found
                continue
            answer.endpoints.update((address, port) for address in found)
        answer.failed_whole = answer.failure is not None and all(
            isinstance(found, LookupFailed) for _, found in results
        )
        return answer

    def _apply(self, state: _TargetState, answer: _Answer) -> None:
        target = state.target
        urls = {
            worker_url(target.scheme, address, port)
            for address, port in answer.endpoints
            if self._usable(state, address)
        }
        if answer.failure is None:
            if state.failures:
                log.info("DNS lookup of %s answers again after %d failures", target.spec, state.failures)
            state.failures = 0
            for url in list(state.listed):
                if url not in urls:
                    state.listed[url] += 1
                    if state.listed[url] >= self.missing_lookups:
                        del state.listed[url]
        else:
            state.failures += 1
            if self.metrics is not None:
                self.metrics.lookup_failures.labels(target.spec, answer.failure.reason).inc()
            if state.failures & (state.failures - 1) == 0:  # the 1st, 2nd, 4th, 8th... in a row
                log.warning(
                    "DNS lookup of %s failed%s (%s; %d in a row): keeping its %d workers",
                    target.spec,
                    "" if answer.failed_whole else " in part",
                    answer.failure,
                    state.failures,
                    len(state.listed),
                )
        for url in urls:
            state.listed[url] = 0
        if self.metrics is not None:
            self.metrics.discovered.labels(target.spec).set(len(state.listed))

    def _usable(self, state: _TargetState, address: IPAddress) -> bool:
        reason = unusable_address(address)
        if reason is None:
            return True
        if address not in state.refused:
            state.refused.add(address)
            log.warning("DNS lookup of %s lists %s, which is %s: refused", state.target.spec, address, reason)
        return False

    def _reconcile(self, tg: TaskGroup) -> list[_Member]:
        wanted: dict[tuple[WorkerKind, str], DnsTarget] = {}
        for state in self._targets:
            for url in state.listed:
                wanted.setdefault((state.target.kind, url), state.target)
        for key, member in self._members.items():
            member.want(key in wanted)
        new = []
        for key, target in wanted.items():
            if key in self._members or self._registered_otherwise(*key):
                continue
            member = self._members[key] = _Member(key[0], key[1], target)
            tg.start_soon(self._keep, member, name=f"dns worker {key[1]}")
            new.append(member)
        return new

    def _registered_otherwise(self, kind: WorkerKind, url: str) -> bool:
        """A worker with this URL and kind came from the command line or the worker API: it stays theirs."""
        return any(w.url == url and w.kind is kind for w in self.fleet.workers.values())

    # -- one worker's life -----------------------------------------------------------------------
    async def _keep(self, member: _Member) -> None:
        """Admit the member's worker, drain it once DNS lets it go, then remove it from the fleet."""
        try:
            try:
                worker = await self.fleet.admit(
                    member.url,
                    member.kind,
                    member.target.engine,
                    worker_id(member.kind, member.url),
                    discovered_by=member.target.spec,
                )
            except GatewayError as exc:  # registered meanwhile through the worker API
                log.warning("cannot add worker %s found in DNS: %s", member.url, exc.message)
                return
            except Exception:
                log.exception("cannot add worker %s found in DNS", member.url)
                return
            finally:
                member.admitted.set()
            log.info(
                "added worker %s (%s, %s) found in DNS by %s",
                worker.id,
                worker.url,
                "healthy" if worker.healthy else "not healthy yet",
                member.target.spec,
            )
            while await self._drained(member, worker) is False:
                worker.draining = False
                log.info("worker %s (%s) is back in DNS: no longer draining", worker.id, worker.url)
            if worker.in_flight:
                log.warning(
                    "removing worker %s (%s) with %d requests still in flight after the %g s drain bound",
                    worker.id,
                    worker.url,
                    worker.in_flight,
                    self.drain_timeout,
                )
            try:
                await self.fleet.remove(worker.id)
            except NotFound:
                pass  # removed meanwhile by someone else
            except Exception:
                log.exception("removing worker %s (%s) failed", worker.id, worker.url)
            else:
                log.debug("removed worker %s (%s) after draining", worker.id, worker.url)
        finally:
            if self._members.get((member.kind, member.url)) is member:
                del self._members[(member.kind, member.url)]

    async def _drained(self, member: _Member, worker: Worker) -> bool:
        """Wait until DNS lets the worker go, then drain it: True once it may be removed (no request
        in flight, or the drain bound passed), False when its address came back first."""
        while member.wanted:
            await member.changed.wait()
        worker.draining = True
        log.info(
            "draining worker %s (%s): gone from DNS, requests in flight: %d",
            worker.id,
            worker.url,
            worker.in_flight,
        )
        with anyio.move_on_after(self.drain_timeout):
            while worker.in_flight > 0 and not member.wanted:
                with anyio.move_on_after(DRAIN_POLL):
                    await member.changed.wait()
        return not member.wanted
