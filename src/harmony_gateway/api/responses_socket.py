"""The Responses API's WebSocket mode: `/v1/responses` upgraded to a WebSocket, as OpenAI's
`client.responses.connect()` and openai-agents' `OpenAIResponsesWSModel` open it.

Handshake: the same keys and tenant rules as a request (`TrafficControl.identify`); a missing or unknown
key is refused with HTTP 401 and OpenAI's error body, a handshake while the gateway drains with 503 (the
socket is never opened). `x-session-id` / `x-user-id` set the routing key of every turn, as on a request.

Client events: `response.create` with the `POST /v1/responses` body (`stream` is implied; `background` is
refused; a `stream_id` is echoed on every event of its response). Each is a turn: traffic control sees
it as one generating request of the socket's key (`traffic.turns.TurnGate`), and it runs through the
Responses service as a stream does (`surfaces/responses/service/socket.py`), its events the same as SSE,
one JSON event per message. A turn continues from the socket's cache of its newest chain, `store: false`
included, or from the store. One response at a time: a `response.create` while one is in flight is an
`error` event (`response_already_in_flight`). What a POST would answer with an HTTP error (bad JSON, an
unknown event type, an invalid body, a budget refusal) is an `error` event with that status, and the
socket stays open; a turn that fails after its first event ends with `response.failed`, as a stream.

Limits (serve's "WebSocket mode" options) and close codes:
- a message over `--ws-max-message-bytes`: 1009, from its frame header, before it is read;
- `--ws-idle-timeout` with no turn running and nothing received: 1000;
- the turn after `--ws-max-turns`, or past `--ws-max-lifetime`: an `error` event
  `websocket_connection_limit_reached`, then 1000 (OpenAI's own code for its 60-minute limit; a client
  opens a new socket and goes on);
- the drain: an idle socket closes at once with 1001 (going away: the SDK counts it as recoverable and may
  reconnect, to another replica); a socket with a turn in flight closes once the turn ended, and a turn
  the drain's timeout cuts ends with an `error` event (503 `shutting_down`) first;
- a gateway bug in the socket's own loop: 1011.
A client that leaves mid-turn cancels the turn, which aborts its engine request.

Metrics: handshakes by outcome, open sockets, closes by reason, error events by code, turns per socket;
each turn is also a request of route `responses_ws` (`gateway_requests_total`, latency, TTFT, tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any, cast

import anyio
import orjson
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from ..errors import (
    AuthenticationFailed,
    Conflict,
    GatewayError,
    InternalError,
    InvalidRequest,
    Overloaded,
    RateLimited,
    is_failure,
)
from ..observability import tracing
from ..observability.logging import log_failure
from ..observability.metrics import MetricSet, counter, finish_request, gauge, histogram
from ..pipeline.context import GatewayState, RequestContext, new_request_id, run_cleanups
from ..pipeline.drive import answer
from ..principal import Principal
from ..settings import Settings
from ..surfaces.responses.service.socket import (
    SocketCache,
    plan_socket_turn,
    socket_body,
    stream_id_of,
)
from ..surfaces.responses.types import ResponsesRequest
from ..surfaces.table import BY_PATH
from ..traffic.keys import KeyPolicy
from ..traffic.middleware import REQUEST_CONTEXT, Ticket, TrafficControl
from ..traffic.turns import TurnGate
from ..types.limits import LOOP_BODY_BYTES
from ..wire import RESPONSES, error_headers, responses_socket_error
from .error_responses import validation_error_to_invalid
from .routes import check_depth

log = logging.getLogger(__name__)

PATH = "/v1/responses"
#: The route of a turn in logs and metrics (a `POST /v1/responses` is "responses").
ROUTE = "responses_ws"
_SURFACE = BY_PATH[PATH]

#: Close codes (RFC 6455 §7.4.1).
NORMAL = 1000
GOING_AWAY = 1001
MESSAGE_TOO_BIG = 1009
INTERNAL_ERROR = 1011

#: The code of the error event that refuses a turn past a socket's limits, OpenAI's for its own.
LIMIT_REACHED = "websocket_connection_limit_reached"


class SocketMetrics(MetricSet):
    """The WebSocket mode's metrics, on the app's registry (each turn is also a request: `ROUTE`)."""

    handshakes = counter(
        "gateway_websocket_handshakes_total",
        "Responses WebSocket handshakes by outcome (accepted, unauthorized, draining, too_many_sockets)",
        ["outcome"],
    )
    open = gauge("gateway_websocket_open", "Responses WebSockets open now", multiprocess_mode="livesum")
    closed = counter(
        "gateway_websocket_closed_total",
        "Responses WebSockets closed, by reason (client, message_too_big, idle, turn_limit, lifetime, "
        "drain, error)",
        ["reason"],
    )
    errors = counter(
        "gateway_websocket_error_events_total",
        "Error events sent on Responses WebSockets, by error code",
        ["code"],
    )
    turns = histogram(
        "gateway_websocket_turns_per_socket",
        "response.create turns each Responses WebSocket ran, observed when it closes",
        buckets=(0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
    )
    continued = counter(
        "gateway_websocket_continuations_total",
        "Turns that continued a previous response, by where its chain was read (socket cache, store)",
        ["source"],
    )


class ResponsesSockets:
    """The app's Responses WebSockets: the ASGI endpoint of the route, and what they share (settings,
    traffic control, metrics once the app has started)."""

    def __init__(self, settings: Settings, control: TrafficControl) -> None:
        self.settings = settings
        self.control = control
        self.metrics: SocketMetrics | None = None
        #: Open sockets per budget owner (`TrafficControl.identify`: a key id or a client address).
        self._open: dict[str, int] = {}

    def attach_metrics(self, metrics: SocketMetrics) -> None:
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message["type"] != "websocket.connect":
            return  # the client left before the handshake
        state: GatewayState = scope["app"].state.gateway
        headers = Headers(scope=scope)
        control = self.control
        if control.draining:
            self._count_handshake("draining")
            await _deny(scope, send, control.refuse_draining())
            return
        identity, policy = control.identify(scope, headers)
        principal: Principal | None = scope.get("state", {}).get("principal")
        if principal is None:
            self._count_handshake("unauthorized")
            await _deny(
                scope,
                send,
                AuthenticationFailed("Incorrect or missing API key: send 'Authorization: Bearer <key>'"),
            )
            return
        owner = identity or ""
        if self._open.get(owner, 0) >= self.settings.ws_max_sockets_per_key:
            self._count_handshake("too_many_sockets")
            await _deny(
                scope,
                send,
                RateLimited(
                    f"this key holds {self.settings.ws_max_sockets_per_key} open Responses WebSockets, the "
                    "most it may: close one first",
                    code="too_many_websockets",
                ),
            )
            return
        self._open[owner] = self._open.get(owner, 0) + 1
        try:
            await self._serve(scope, state, principal, identity, policy, headers, receive, send)
        finally:
            left = self._open[owner] - 1
            if left:
                self._open[owner] = left
            else:
                del self._open[owner]

    async def _serve(
        self,
        scope: Scope,
        state: GatewayState,
        principal: Principal,
        identity: str | None,
        policy: KeyPolicy | None,
        headers: Headers,
        receive: Receive,
        send: Send,
    ) -> None:
        self._count_handshake("accepted")
        await send({"type": "websocket.accept"})
        socket = ResponsesSocket(
            self,
            state,
            principal,
            TurnGate(self.control, identity, policy),
            headers.get("x-session-id") or headers.get("x-user-id"),
            receive,
            send,
        )
        metrics = self.metrics
        if metrics is not None:
            metrics.open.inc()
        reason = "error"
        try:
            reason = await socket.serve()
        finally:
            if metrics is not None:
                metrics.open.dec()
                metrics.closed.labels(reason).inc()
                metrics.turns.observe(socket.turns)

    def _count_handshake(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.handshakes.labels(outcome).inc()


async def _deny(scope: Scope, send: Send, exc: GatewayError) -> None:
    """Refuse the handshake with `exc`'s HTTP status and OpenAI error body (a plain 403 where the server
    cannot send a response to a WebSocket handshake)."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    status, body = RESPONSES.error_body(exc)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [
        (name.encode(), value.encode())
        for name, value in error_headers(RESPONSES, exc, new_request_id()).items()
    ]
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


class ResponsesSocket:
    """One open socket: reads client events, runs one turn at a time (a task of its own, so the socket
    keeps reading: a second `response.create`, the client leaving, the drain), and closes it."""

    def __init__(
        self,
        hub: ResponsesSockets,
        state: GatewayState,
        principal: Principal,
        gate: TurnGate,
        routing_key: str | None,
        receive: Receive,
        send: Send,
    ) -> None:
        self.hub = hub
        self.state = state
        self.settings = hub.settings
        self.principal = principal
        self.gate = gate
        self.routing_key = routing_key
        self.receive = receive
        self._send = send
        self.cache = SocketCache(state.store)
        self.turns = 0
        #: True from a turn's start until its last event (or its error event) is handed to the socket.
        self.busy = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task[None]] = set()
        #: The client left while the socket was sending to it.
        self.gone = False
        loop = asyncio.get_running_loop()
        self._clock = loop.time
        self.opened = self._clock()
        self.last_activity = self.opened

    # -- the socket's loop ----------------------------------------------------------------------------
    async def serve(self) -> str:
        """Read and answer client events until the socket closes; returns why it closed."""
        drain = asyncio.ensure_future(self.hub.control.drain_begun.wait())
        incoming: asyncio.Future[Any] | None = None
        turn_over: asyncio.Future[Any] | None = None
        try:
            while True:
                if incoming is None:
                    incoming = asyncio.ensure_future(self.receive())
                waiting: set[asyncio.Future[Any]] = {incoming, drain}
                timeout = None
                if self.busy:
                    if turn_over is None:
                        turn_over = asyncio.ensure_future(self._idle.wait())
                    waiting.add(turn_over)
                else:
                    timeout = max(0.0, self.last_activity + self.settings.ws_idle_timeout - self._clock())
                done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if turn_over is not None and turn_over.done():
                    turn_over = None
                if incoming in done:
                    message, incoming = incoming.result(), None
                    if message["type"] == "websocket.disconnect":
                        return "message_too_big" if message.get("code") == MESSAGE_TOO_BIG else "client"
                    self.last_activity = self._clock()
                    ended = await self._on_message(message)
                    if ended is not None:
                        return ended
                if self.busy:
                    continue
                if drain.done():
                    await self.close(GOING_AWAY, "the gateway is shutting down")
                    return "drain"
                if self._clock() >= self.last_activity + self.settings.ws_idle_timeout:
                    await self.close(NORMAL, "idle timeout")
                    return "idle"
        except BaseException as exc:
            if is_failure(exc):
                log_failure(log, "Responses WebSocket", exc)
                await self.close(INTERNAL_ERROR, "internal error")
                return "error"
            raise
        finally:
            for waiter in (incoming, drain, turn_over):
                if waiter is not None:
                    waiter.cancel()
            await self._end_turns()

    async def _on_message(self, message: dict[str, Any]) -> str | None:
        """Answer one client message; the close reason when it closed the socket, else None."""
        data: str | bytes | None = message.get("text")
        if data is None:
            data = message.get("bytes") or b""
        stream_id: str | None = None
        try:
            event = await _decode_event(data)
            kind = event.get("type")
            if kind != "response.create":
                raise InvalidRequest(
                    f"unsupported event type {kind!r}: this socket accepts response.create"
                    if isinstance(kind, str)
                    else "a client event needs a string 'type' (response.create)",
                    param="type",
                    code="invalid_event",
                )
            stream_id = stream_id_of(event)
            if self.busy:
                raise Conflict(
                    "a response is already in flight on this socket; send the next response.create "
                    "after its terminal event",
                    code="response_already_in_flight",
                )
        except GatewayError as exc:
            await self._refuse(exc, len(data), stream_id)
            return None
        if self.hub.control.draining:
            await self.close(GOING_AWAY, "the gateway is shutting down")
            return "drain"
        limit = self._limit_reached()
        if limit is not None:
            reason, message_text = limit
            await self.send_error(InvalidRequest(message_text, code=LIMIT_REACHED), stream_id)
            await self.close(NORMAL, "connection limit reached")
            return reason
        self.busy = True
        self._idle.clear()
        self.turns += 1
        task = asyncio.create_task(self._turn(event, len(data), stream_id), name="responses-socket-turn")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return None

    async def _refuse(self, exc: GatewayError, size: int, stream_id: str | None) -> None:
        """Answer a message that starts no turn with `exc`, charged what a refused POST costs (the
        budget's own refusal instead, once it is spent)."""
        answer = exc
        try:
            await self.gate.charge(size)
        except RateLimited as refusal:
            answer = refusal
        await self.send_error(answer, stream_id)

    def _limit_reached(self) -> tuple[str, str] | None:
        settings = self.settings
        if self.turns >= settings.ws_max_turns:
            return "turn_limit", (
                f"this WebSocket ran its {settings.ws_max_turns} turns; open a new connection to go on"
            )
        if self._clock() - self.opened >= settings.ws_max_lifetime:
            return "lifetime", (
                f"this WebSocket reached its {settings.ws_max_lifetime:g} s lifetime; open a new "
                "connection to go on"
            )
        return None

    def _release(self) -> None:
        """The turn's last message is out: the socket takes the next `response.create`. Called right
        after that message is written, with no suspension in between, so a client that answers at once
        never finds the turn still in flight."""
        if self.busy:
            self.busy = False
            self.last_activity = self._clock()
            self._idle.set()

    async def _end_turns(self) -> None:
        """When the socket closes: a turn still in flight is cancelled (its engine request aborted);
        turns past their last event finish their bookkeeping."""
        for task in list(self._tasks):
            if self.busy:
                task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks))

    # -- sending ----------------------------------------------------------------------------------------
    async def send_lines(self, piece: bytes) -> None:
        """Send each line of `piece` (one event each) as one text message."""
        send = self._send
        try:
            for line in piece.split(b"\n"):
                if line:
                    await send({"type": "websocket.send", "text": line.decode()})
        except OSError:  # uvicorn's ClientDisconnected: the client left
            self.gone = True
            raise

    async def send_error(
        self,
        exc: GatewayError,
        stream_id: str | None,
        *,
        request_id: str | None = None,
        sequence_number: int | None = None,
    ) -> None:
        headers = error_headers(RESPONSES, exc, request_id or new_request_id())
        if isinstance(exc, RateLimited):
            headers.update(self.gate.headers)  # the key's budgets, as a request's 429 carries them
        event = responses_socket_error(exc, headers, sequence_number=sequence_number)
        if stream_id is not None:
            event["stream_id"] = stream_id
        metrics = self.hub.metrics
        if metrics is not None:
            metrics.errors.labels(str(exc.code)).inc()
        with contextlib.suppress(Exception):  # the client may be gone
            await self._send({"type": "websocket.send", "text": orjson.dumps(event).decode()})

    async def close(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):  # the client may be gone
            await self._send({"type": "websocket.close", "code": code, "reason": reason})

    # -- a turn -------------------------------------------------------------------------------------------
    async def _turn(self, event: dict[str, Any], size: int, stream_id: str | None) -> None:
        """One `response.create`, start to end: traffic control, the response's run, its error event
        when it fails before its first event; logged and counted as a request of `ROUTE`."""
        ctx = RequestContext(
            request_id=new_request_id(),
            route=ROUTE,
            principal=self.principal,
            routing_key=self.routing_key,
            metrics=self.state.metrics,
            wire=RESPONSES,
        )
        span, token = tracing.start_request_span(
            f"WEBSOCKET {PATH} response.create", {}, {"url.path": PATH, "gateway.transport": "websocket"}
        )
        started = [False]
        try:
            finished = await self.gate.run(
                {REQUEST_CONTEXT: ctx},
                size,
                event,
                lambda ticket: self._generate(ctx, event, size, stream_id, ticket, started),
            )
            if not finished:
                # The drain's timeout cut the turn: its engine request is aborted; the client hears why.
                ctx.status = 503
                cut = Overloaded("the gateway shut down before this response finished", code="shutting_down")
                self._release()
                await self.send_error(
                    cut,
                    stream_id,
                    request_id=ctx.request_id,
                    sequence_number=ctx.sent_sequence if started[0] else None,
                )
        except BaseException as exc:
            if not is_failure(exc):
                raise
            if self.gone:
                ctx.status = 499  # the client left while its events were being sent: nothing to tell it
                return
            refusal = _as_gateway_error(exc)
            if refusal is None:
                log_failure(log, f"WebSocket turn {ctx.request_id}", exc)
                refusal = InternalError("internal error")
            ctx.status = RESPONSES.error_response(refusal)[0]
            self._release()
            await self.send_error(refusal, stream_id, request_id=ctx.request_id)
        finally:
            self._release()
            await run_cleanups(ctx)
            finish_request(ctx)
            tracing.end_request_span(span, token, ctx.status)

    async def _generate(
        self,
        ctx: RequestContext,
        event: dict[str, Any],
        size: int,
        stream_id: str | None,
        ticket: Ticket,
        started: list[bool],
    ) -> None:
        """The turn's response, admitted: validated, planned and streamed to the socket."""
        body = socket_body(event)
        if self.settings.log_prompts:
            for field in _SURFACE.prompt_fields:
                if body.get(field) is not None:
                    ctx.log_extra[field] = body[field]
                    tracing.annotate_prompt(field, body[field])
        request = await _validated(body, large=size > LOOP_BODY_BYTES)
        turn = await plan_socket_turn(self.state, request, ctx, self.cache, stream_id=stream_id)
        source = self.cache.source
        if source is not None and self.hub.metrics is not None:
            self.hub.metrics.continued.labels(source).inc()
        stream = cast(AsyncGenerator[bytes, None], await answer(ctx, turn.generation))
        async with contextlib.aclosing(stream):
            async for piece in stream:
                last = turn.ended()
                await self.send_lines(piece)
                ctx.sent_sequence = ctx.next_sequence
                if last:
                    turn.remember()
                    self._release()
                    ticket.free_slot()  # the next turn may start at once: its slot must be free
                if not started[0]:
                    started[0] = True
                    ticket.charge_started()  # the prompt is known: charge it now, as a request does


def _as_gateway_error(exc: BaseException) -> GatewayError | None:
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, ValidationError):
        return validation_error_to_invalid(exc)
    return None


async def _decode_event(data: str | bytes) -> dict[str, Any]:
    """A client message as a JSON object; InvalidRequest for one that is not (or nests too deep)."""

    def decode() -> dict[str, Any]:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"the message is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(event, dict):
            raise InvalidRequest("a client event is a JSON object", code="invalid_event")
        check_depth(event)
        return event

    if len(data) <= LOOP_BODY_BYTES:
        return decode()
    return await anyio.to_thread.run_sync(decode)


async def _validated(body: dict[str, Any], *, large: bool) -> ResponsesRequest:
    if large:
        return await anyio.to_thread.run_sync(ResponsesRequest.model_validate, body)
    return ResponsesRequest.model_validate(body)


__all__ = ["PATH", "ROUTE", "ResponsesSocket", "ResponsesSockets", "SocketMetrics"]
