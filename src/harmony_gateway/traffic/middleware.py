"""`TrafficMiddleware`: the one place traffic control meets HTTP, as a pure ASGI middleware.

Per request, in order:
1. the request's trace span (continuing the client's `traceparent`);
2. routes in `traffic.routes.UNCONTROLLED` (probes, the playground's static files) go straight to the
   app; every other route is controlled, at the cost `RouteMap.cost` gives it (the generating routes come
   from the surface table);
3. while draining: `/readiness` and every controlled request answer 503 with `retry-after`;
4. the key's (or address's) budgets: the route's weight is taken from the request budget; a generating
   route reserves its estimated tokens (`traffic.routes.estimate_tokens`, from its body, which is read
   here and replayed to the app) from the token budget, other routes only read it; every response
   carries `x-ratelimit-*`, a refusal is a 429 `rate_limit_exceeded` with `retry-after`;
5. admission for routes that take a slot: a slot at once, a place in the queue, or a 429 (`queue_full`,
   later `queue_timeout`) with `retry-after`; a client that
   leaves while queued gives its place up at once (its disconnect is watched while it waits);
6. the app; as the response starts, tokens used beyond the reservation (from the request's
   `RequestContext`) are charged; the slot is released when its last byte is sent or the client
   leaves, and the reservation is settled to the real count then (what was not used is given back).
Every refusal is answered on the route's wire (`RouteMap.wire`: Anthropic's shape on the Messages
API); a request cut by the drain timeout ends on the wire its route set on its `RequestContext` (a
stream with its wire's terminal frame, numbered after the last event it sent).
A background response takes over its request's `Ticket` (`current_ticket`), holding the slot and
charging its tokens when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..asgi import HttpMiddleware
from ..errors import GatewayError, Overloaded, RateLimited
from ..observability import tracing
from ..observability.metrics import MetricSet, counter, gauge, histogram
from ..principal import authenticate, presented_key
from ..settings import Settings
from ..tasks import TaskSupervisor
from ..types.limits import LOOP_BODY_BYTES
from ..wire import Wire, WiredRequest, error_headers
from .admission import Admission, SharedSlots, Slot
from .keys import KeyPolicy, KeyRing
from .rate_limit import BucketState, LocalBuckets, RedisBuckets, headers_for
from .routes import RouteCost, RouteMap, estimate_tokens

log = logging.getLogger(__name__)


#: The request's ticket, for a background response to take over (`BackgroundRunner.start`).
current_ticket: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("traffic_ticket", default=None)


class TrafficMetrics(MetricSet):
    """Admission and rate-limit metrics, on the app's `GatewayMetrics` registry. The gauges of a
    component exist only when it is configured (`AdmissionGauges` with `--max-concurrent-requests`,
    `RateLimitStoreGauges` with a Redis `--rate-limit-store`): a gauge that reads 0 for something the
    gateway does not run is a false alarm for any alert rule."""

    admission_wait = histogram(
        "gateway_admission_wait_seconds",
        "Time admitted requests waited in the queue",
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    )
    admission_refused = counter(
        "gateway_admission_refused_total",
        "Requests refused by admission, by reason (queue_full, queue_timeout, draining)",
        ["reason"],
    )
    rate_limited = counter(
        "gateway_rate_limited_total",
        "Requests refused by a rate limit, by limit (requests, tokens)",
        ["limit"],
    )

    def __init__(self, registry: Any, *, admission: bool = False, shared_store: bool = False) -> None:
        super().__init__(registry)
        self.admission_gauges = AdmissionGauges(registry) if admission else None
        self.store_gauges = RateLimitStoreGauges(registry) if shared_store else None


class AdmissionGauges(MetricSet):
    """Admission's gauges: only on a gateway with a concurrency limit."""

    in_flight = gauge(
        "gateway_admission_in_flight",
        "Generation requests admitted and not finished",
        multiprocess_mode="livesum",
    )
    queue_depth = gauge(
        "gateway_admission_queue_depth",
        "Generation requests waiting for admission",
        multiprocess_mode="livesum",
    )


class RateLimitStoreGauges(MetricSet):
    """The shared rate-limit store's gauge: only on a gateway whose budgets live in Redis."""

    up = gauge(
        "gateway_rate_limit_store_up",
        "1 while the shared rate-limit store (Redis) answers, 0 while budgets are per process",
        multiprocess_mode="min",
    )


class Ticket:
    """One admitted request: its slot and the budgets its tokens are charged to, settled once.

    `reserved` tokens were taken at admission; what the request uses beyond them is charged as the
    response starts (the prompt is known by then), and when it ends the charge is settled to the real
    count (a request that used less gets the rest back)."""

    __slots__ = (
        "_control",
        "charged",
        "detached",
        "identity",
        "policy",
        "scope_state",
        "settled",
        "slot",
    )

    def __init__(
        self,
        control: TrafficControl,
        slot: Slot | None,
        identity: str | None,
        policy: KeyPolicy | None,
        scope_state: dict[str, Any],
        reserved: int = 0,
    ) -> None:
        self._control = control
        self.slot = slot
        self.identity = identity
        self.policy = policy
        self.scope_state = scope_state
        self.detached = False
        self.settled = False
        #: Tokens taken from the budget so far, the reservation included.
        self.charged = reserved

    def detach(self) -> None:
        """A background task now owns this ticket and settles it when it ends."""
        self.detached = True

    def _owed(self) -> tuple[int, int]:
        """(token limit, tokens used minus tokens charged): negative while the reservation covers
        more than the request used."""
        limit = self._control.token_limit(self.policy)
        if not limit or self.identity is None:
            return 0, 0
        ctx = self.scope_state.get(REQUEST_CONTEXT)
        used = ctx.prompt_tokens + ctx.completion_tokens if ctx is not None else 0
        return limit, used - self.charged

    def charge_started(self) -> None:
        """The response is starting: charge what the request used so far (its prompt), off the send path."""
        limit, owed = self._owed()
        if owed > 0 and not self._control.tasks.closed:  # after shutdown, nothing is charged any more
            self.charged += owed
            self._control.tasks.spawn(self._charge(limit, owed), name="traffic-charge")

    async def _charge(self, limit: int, tokens: int) -> None:
        await self._control.buckets.run(f"{self.identity}:tokens", limit, "charge", tokens)

    def free_slot(self) -> None:
        """Give the admission slot back now (the response's last byte is out), ahead of `settle`."""
        if self.slot is not None:
            slot, self.slot = self.slot, None
            slot.release()

    async def settle(self) -> None:
        if self.settled:
            return
        self.settled = True
        if self.slot is not None:
            self.slot.release()
        limit, owed = self._owed()
        if owed:  # negative: the unused part of the reservation goes back
            self.charged += owed
            await self._charge(limit, owed)


class TrafficControl:
    """The gateway's traffic state: admission, budgets and the drain. Built with the app; token
    charges sent off the response path are tasks of the app's `tasks`."""

    def __init__(
        self,
        settings: Settings,
        registry: Any = None,
        shared_slots_path: str | None = None,
        *,
        tasks: TaskSupervisor,
        keys: KeyRing | None = None,
    ) -> None:
        self.settings = settings
        #: The tenant keys in force (a key file reload changes them).
        self.keys = keys if keys is not None else KeyRing.from_settings(settings)
        self.tasks = tasks
        self.metrics: TrafficMetrics | None = None
        self.admission: Admission | None = None
        if settings.max_concurrent_requests:
            shared = (
                SharedSlots(shared_slots_path, settings.max_concurrent_requests)
                if shared_slots_path
                else None
            )
            self.admission = Admission(
                settings.max_concurrent_requests,
                settings.queue_size,
                settings.queue_timeout,
                shared=shared,
            )
        self.buckets: LocalBuckets | RedisBuckets = (
            RedisBuckets(settings.rate_limit_store) if settings.rate_limit_store else LocalBuckets()
        )
        if registry is not None:
            self.attach_metrics(registry)
        self.draining = False
        #: Set when the drain begins: long-lived connections (Responses WebSockets) close then.
        self.drain_begun = asyncio.Event()
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._scopes: set[anyio.CancelScope] = set()
        self._drain_expired = False
        #: Running background responses (set by the app): the drain waits for them too.
        self.background_running: Callable[[], int] = lambda: 0

    @property
    def limits_on(self) -> bool:
        """Some budget applies: a gateway-wide limit, or a key's own (which a key file reload may add)."""
        return bool(self.settings.rate_limit or self.settings.token_rate_limit or self.keys.has_limits)

    def attach_metrics(self, registry: Any) -> None:
        """Record on `registry` (the app's `GatewayMetrics.registry`): counters always, the gauges of
        what is configured (admission, a shared rate-limit store) only."""
        redis = self.buckets if isinstance(self.buckets, RedisBuckets) else None
        metrics = TrafficMetrics(
            registry, admission=self.admission is not None, shared_store=redis is not None
        )
        self.metrics = metrics
        if self.admission is not None:
            self.admission.metrics = metrics
            self.admission.report()
        if redis is not None:
            redis.gauges = metrics.store_gauges
            redis.report()

    def request_limit(self, policy: KeyPolicy | None) -> int | None:
        return (policy.rate_limit if policy and policy.rate_limit else None) or self.settings.rate_limit

    def token_limit(self, policy: KeyPolicy | None) -> int | None:
        return (
            policy.token_rate_limit if policy and policy.token_rate_limit else None
        ) or self.settings.token_rate_limit

    def identify(self, scope: Scope, headers: Headers) -> tuple[str | None, KeyPolicy | None]:
        """The budget's owner: the API key's id, or the client address when the gateway has no keys;
        None for an unknown key (the route answers 401). The principal found is kept on the request
        (`state.principal`), so the route does not authenticate twice."""
        principal = authenticate(self.keys, headers)
        if principal is None:
            return None, None
        scope.setdefault("state", {})["principal"] = principal
        if not principal.key_id:
            client = scope.get("client")
            return f"addr:{client[0] if client else 'unknown'}", None
        return f"key:{principal.key_id}", self.keys.key_policies.get(presented_key(headers))

    def priority(self, policy: KeyPolicy | None) -> int:
        return policy.priority if policy is not None and policy.priority is not None else 0

    async def check_budgets(
        self, identity: str, policy: KeyPolicy | None, weight: float, tokens: int | None
    ) -> tuple[list[tuple[bytes, bytes]], RateLimited | None, int]:
        """Take `weight` from the key's request budget and reserve `tokens` (None: only read the token
        budget) from its token budget: the headers to send, the refusal when either does not fit, and
        the tokens reserved. A reservation is at most the whole budget: a request estimated above it
        is admitted only on a full bucket, and its settlement leaves the bucket in debt."""
        headers: list[tuple[bytes, bytes]] = []
        refusal: RateLimited | None = None
        reserved = 0
        limit = self.request_limit(policy)
        if limit:
            state = await self.buckets.run(f"{identity}:requests", limit, "take", weight)
            headers += headers_for("requests", state)
            if not state.allowed:
                refusal = self._refusal("requests", limit, state, weight)
        limit = self.token_limit(policy)
        if limit:
            wanted = min(tokens, limit) if tokens is not None and refusal is None else 0
            state = await self.buckets.run(f"{identity}:tokens", limit, "take" if wanted else "peek", wanted)
            headers += headers_for("tokens", state)
            if not state.allowed:
                refusal = self._refusal("tokens", limit, state, wanted)
            else:
                reserved = wanted
        return headers, refusal, reserved

    def _refusal(self, kind: str, limit: int, state: BucketState, needed: float) -> RateLimited:
        if self.metrics is not None:
            self.metrics.rate_limited.labels(limit=kind).inc()
        wanted = f"Requested {needed:g}, available {state.remaining}. " if kind == "tokens" else ""
        return RateLimited(
            f"Rate limit reached: {limit} {kind} per minute. {wanted}"
            f"Retry after {state.retry_after(needed):.0f}s.",
            retry_after=state.retry_after(needed),
        )

    # -- drain ---------------------------------------------------------------------------------

    def refuse_draining(self) -> Overloaded:
        """The refusal of a request that arrives while draining (counted)."""
        if self.metrics is not None:
            self.metrics.admission_refused.labels(reason="draining").inc()
        return Overloaded("the gateway is shutting down; retry on another replica", code="shutting_down")

    def _enter(self, scope: anyio.CancelScope) -> None:
        self.in_flight += 1
        self._scopes.add(scope)
        self._idle.clear()

    def _leave(self, scope: anyio.CancelScope) -> None:
        self.in_flight -= 1
        self._scopes.discard(scope)
        if self.in_flight == 0:
            self._idle.set()

    def begin_drain(self) -> None:
        if not self.draining:
            self.draining = True
            self.drain_begun.set()
            log.warning(
                "draining: refusing new requests; %d in flight finish within %gs",
                self.in_flight,
                self.settings.drain_timeout,
            )

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests and wait for in-flight ones and background responses; past `timeout`
        cut what is left (streams end with a terminal error event). True when all finished in time."""
        self.begin_drain()
        timeout = self.settings.drain_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.in_flight == 0 and self.background_running() == 0:
                log.warning("drained: every request finished")
                return True
            # Woken by the last request leaving; background responses are polled.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), min(0.1, max(0.0, deadline - time.monotonic())))
        log.warning("drain timeout: cutting %d requests still in flight", self.in_flight)
        self._drain_expired = True
        for scope in list(self._scopes):
            scope.cancel()
        return False

    async def run(self) -> None:
        """What traffic control does in the background, run by the app lifespan until shutdown:
        with admission slots shared between processes, admitting waiters when another process frees one."""
        if self.admission is not None and self.admission.shared is not None:
            await self.admission.poll_shared()

    async def close(self) -> None:
        if isinstance(self.buckets, RedisBuckets):
            await self.buckets.close()


async def _send_error(
    send: Send, wire: Wire, exc: GatewayError, request_id: str, extra: list[tuple[bytes, bytes]]
) -> None:
    status, body = wire.error_body(exc)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    headers += [
        (name.encode(), value.encode()) for name, value in error_headers(wire, exc, request_id).items()
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class TrafficMiddleware(HttpMiddleware):
    def __init__(self, app: ASGIApp, control: TrafficControl, routes: RouteMap) -> None:
        super().__init__(app)
        self.control = control
        self.routes = routes

    async def handle_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        headers = Headers(scope=scope)
        attributes: dict[str, Any] = {"http.request.method": scope["method"], "url.path": path}
        span, token = tracing.start_request_span(f"{scope['method']} {path}", headers, attributes)
        status: list[int] = [0]
        try:
            await self._handle(scope, receive, send, path, headers, status)
        finally:
            tracing.end_request_span(span, token, status[0] or None)

    async def _handle(
        self, scope: Scope, receive: Receive, send: Send, path: str, headers: Headers, status: list[int]
    ) -> None:
        control = self.control
        request_id = scope.get("state", {}).get("request_id") or ""
        cost = self.routes.cost(scope["method"], path)
        wire = self.routes.wire(scope["method"], path)
        if cost is None:
            if path == "/readiness" and control.draining:
                status[0] = 503
                exc = Overloaded("the gateway is shutting down", code="shutting_down")
                await _send_error(send, wire, exc, request_id, [])
                return
            await self.app(scope, receive, send)
            return
        if control.draining:
            status[0] = 503
            await _send_error(send, wire, control.refuse_draining(), request_id, [(b"connection", b"close")])
            return
        # Counted from here, queued or running: the drain waits for every request it did not refuse,
        # and past its timeout cancels this scope.
        watch = _ResponseWatch(send, status, wire, scope.setdefault("state", {}))
        cancel_scope = anyio.CancelScope()
        control._enter(cancel_scope)
        try:
            with cancel_scope:
                await self._admit_and_run(scope, receive, watch, headers, request_id, cost)
            if cancel_scope.cancelled_caught:
                # End the request in its route's own error shape (a stream gets a terminal event).
                await watch.cut(
                    Overloaded("the gateway shut down before this response finished", code="shutting_down")
                )
        finally:
            control._leave(cancel_scope)

    async def _admit_and_run(
        self,
        scope: Scope,
        receive: Receive,
        watch: _ResponseWatch,
        headers: Headers,
        request_id: str,
        cost: RouteCost,
    ) -> None:
        control = self.control
        identity, policy = control.identify(scope, headers)
        reserved = 0
        if control.limits_on and identity is not None:
            tokens: int | None = None
            if cost.tokens and control.token_limit(policy):
                try:
                    tokens, receive = await _estimate_from_body(scope, receive)
                except GatewayError as exc:  # the body broke --max-body-bytes or --body-timeout
                    await _send_error(watch, watch.wire, exc, request_id, [])
                    return
            weight = cost.weight(_declared_length(headers))
            watch.extra, refusal, reserved = await control.check_budgets(identity, policy, weight, tokens)
            if refusal is not None:
                await _send_error(watch, watch.wire, refusal, request_id, [])
                return
        ticket = Ticket(control, None, identity, policy, scope.setdefault("state", {}), reserved)
        try:
            await self._run_admitted(scope, receive, watch, request_id, cost, ticket)
        finally:
            if not ticket.detached:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await ticket.settle()

    async def _run_admitted(
        self,
        scope: Scope,
        receive: Receive,
        watch: _ResponseWatch,
        request_id: str,
        cost: RouteCost,
        ticket: Ticket,
    ) -> None:
        """Admission (when the route takes a slot), then the app, with `ticket` current."""
        control = self.control
        slot: Slot | None = None
        # An unknown key takes no place: the route answers 401 at once.
        if cost.admission and control.admission is not None and ticket.identity is not None:
            try:
                with tracing.span("gateway.admission"):
                    slot, receive = await _acquire_watching(
                        control.admission, control.priority(ticket.policy), receive
                    )
            except RateLimited as refusal:
                await _send_error(watch, watch.wire, refusal, request_id, [])
                return
            if slot is None:
                return  # the client left while queued
        ticket.slot = slot
        watch.ticket = ticket
        reset = current_ticket.set(ticket)
        try:
            await self.app(scope, receive, watch)
        finally:
            current_ticket.reset(reset)


class _ResponseWatch:
    """The app's `send`: adds the budget headers, times the stream span, and can end a cut response on
    its wire: the wire of the request's route, or the one its route set on the `RequestContext` it left
    in the request's state (with the numbering of its stream), never read back from the bytes sent."""

    __slots__ = (
        "_scope_state",
        "_send",
        "_span",
        "_status",
        "extra",
        "finished",
        "started",
        "streaming",
        "ticket",
        "wire",
    )

    def __init__(self, send: Send, status: list[int], wire: Wire, scope_state: dict[str, Any]) -> None:
        self._send = send
        #: The budget headers, added to the response's headers.
        self.extra: list[tuple[bytes, bytes]] = []
        self._status = status
        #: The wire the request's route answers on (`RouteMap.wire`), until the route says.
        self.wire = wire
        self._scope_state = scope_state
        self._span: Any = None
        self.ticket: Ticket | None = None
        self.started = False
        self.finished = False
        self.streaming = False

    def __call__(self, message: Message) -> Awaitable[None]:
        # Hands on `send`'s own awaitable: no frame of its own for every streamed piece.
        kind = message["type"]
        if kind == "http.response.start":
            self.started = True
            self._status[0] = message["status"]
            if self.ticket is not None:
                self.ticket.charge_started()
            if self.extra:
                message = dict(message)
                message["headers"] = [*message.get("headers", []), *self.extra]
            for name, value in message.get("headers", []):
                if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                    self.streaming = True
                    self._span = tracing.start_span("gateway.stream")
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.finished = True
            self._end_span()
        return self._send(message)

    def _end_span(self) -> None:
        if self._span is not None:
            self._span.end()
            self._span = None

    async def cut(self, exc: GatewayError) -> None:
        self._end_span()
        request: WiredRequest | None = self._scope_state.get(REQUEST_CONTEXT)
        with contextlib.suppress(Exception):  # the client may be gone too
            if not self.started:
                wire = self.wire if request is None else request.wire
                await _send_error(self, wire, exc, "", [])
            elif self.streaming and not self.finished:
                # A stream starts only inside a route, which sets the request's context first.
                frame = request.cut_frame(exc) if request is not None else self.wire.stream_error(exc, 0)
                await self._send({"type": "http.response.body", "body": frame, "more_body": False})


#: The request state key under which the route leaves its `RequestContext` (api/routes.py
#: `new_context`): read for the tokens to charge and, when the request is cut, its wire.
REQUEST_CONTEXT = "request_context"


#: The request state key under which traffic control leaves the JSON it decoded for the route's
#: `json_body` (api/routes.py), which takes it once.
DECODED_BODY = "decoded_json_body"


def _declared_length(headers: Headers) -> int:
    value = headers.get("content-length", "")
    return int(value) if value.isdigit() else 0


async def _estimate_from_body(scope: Scope, receive: Receive) -> tuple[int, Receive]:
    """The tokens a generation request may use (`estimate_tokens`), read from its body, and the
    `receive` that replays the body to the app. The body is bounded by the request guard outside
    (--max-body-bytes, --body-timeout), whose errors propagate; a body that is not JSON is estimated
    by its size alone and left for the route to refuse. What was decoded is kept for the route
    (`DECODED_BODY`), so an 8 MiB body is decoded once, not twice."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
    try:
        if len(body) <= LOOP_BODY_BYTES:
            request = orjson.loads(body)
        else:
            request = await anyio.to_thread.run_sync(orjson.loads, body)
    except orjson.JSONDecodeError:
        request = None
    if request is not None:
        scope.setdefault("state", {})[DECODED_BODY] = request

    async def replay() -> Message:
        if messages:
            return messages.pop(0)
        return await receive()

    return estimate_tokens(body, request), replay


async def _acquire_watching(
    admission: Admission, priority: int, receive: Receive
) -> tuple[Slot | None, Receive]:
    """A slot, waiting while watching the connection: (None, _) when the client left first; raises
    `RateLimited` when refused. Messages
    read meanwhile (the request body) are replayed to the app by the returned `receive`."""
    slot = admission.try_acquire()
    if slot is not None:
        return slot, receive
    buffered: list[Message] = []

    async def watch() -> None:
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] == "http.disconnect":
                return

    acquire = asyncio.ensure_future(admission.acquire(priority))
    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({acquire, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not acquire.done():
            acquire.cancel()
        await asyncio.gather(acquire, watcher, return_exceptions=True)
    if acquire.cancelled():
        return None, receive  # the client left: its place is given up
    slot = acquire.result()  # raises RateLimited
    if buffered and buffered[-1]["type"] == "http.disconnect":
        slot.release()
        return None, receive

    async def replay() -> Message:
        if buffered:
            return buffered.pop(0)
        return await receive()

    return slot, replay


__all__ = [
    "AdmissionGauges",
    "RateLimitStoreGauges",
    "Ticket",
    "TrafficControl",
    "TrafficMetrics",
    "TrafficMiddleware",
    "current_ticket",
]
