"""Thin HTTP handlers: parse the body, build a RequestContext, call the pipeline, write the response."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import anyio
import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from ..errors import AuthenticationFailed, InvalidRequest, NoHealthyWorker, Overloaded, is_failure
from ..observability import tracing
from ..observability.logging import CLIENT_CLOSED, requested_model
from ..observability.metrics import finish_request
from ..pipeline.context import CLEANUP_TIMEOUT, GatewayState, RequestContext, new_request_id, run_cleanups
from ..pipeline.drive import answer
from ..pipeline.reasoning_budget import budget_exceeded
from ..principal import ADMIN, Principal, authenticate
from ..surfaces.table import SURFACES, Surface
from ..traffic.middleware import DECODED_BODY, REQUEST_CONTEXT
from ..types.limits import LOOP_BODY_BYTES
from ..wire import OPENAI, Wire
from .error_responses import param_from_loc, validation_error_to_invalid

router = APIRouter()
log = logging.getLogger(__name__)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
#: What a stream cut from outside (a drain's timeout, a shutdown) is recorded as.
SHUTTING_DOWN = Overloaded("the gateway shut down before this response finished", code="shutting_down")
#: Deeper bodies are refused: the gateway stores and echoes what it was sent, and orjson writes at most
#: 254 levels (openai-harmony gives up on a tool schema at about 120).
MAX_JSON_DEPTH = 128


def gateway(request: Request) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


def principal_of(state: GatewayState, request: Request, *, admin: bool = False) -> Principal:
    """The request's tenant principal (`ANONYMOUS` when the gateway is open); 401 when keys are
    configured and the request's key is missing or unknown. Traffic control authenticated it already on
    the routes it sees; the principal it found is reused. `admin`: the request holds the admin
    credential (api/admin.py), which stands in for a missing tenant key as the `ADMIN` principal."""
    principal = request.scope.get("state", {}).get("principal")
    if principal is None:
        principal = authenticate(state.keys, request.headers)
        if principal is None:
            if not admin:
                raise AuthenticationFailed("Incorrect or missing API key: send 'Authorization: Bearer <key>'")
            principal = ADMIN
        request.state.principal = principal
    return principal  # type: ignore[no-any-return]


def owner_of(state: GatewayState, request: Request) -> str:
    """The tenant that owns what the request stores and reads (see `principal_of`)."""
    return principal_of(state, request).tenant


def new_context(
    request: Request, route: str, state: GatewayState, *, wire: Wire = OPENAI, admin: bool = False
) -> RequestContext:
    """The request's context on `wire`, left in its ASGI state for traffic control (which charges its
    tokens and, when it cuts the request's stream, ends it on its wire)."""
    request_id = getattr(request.state, "request_id", None) or new_request_id()
    request.state.request_id = request_id  # before authenticating: a 401 carries it too
    principal = principal_of(state, request, admin=admin)
    routing_key = request.headers.get("x-session-id") or request.headers.get("x-user-id")
    ctx = RequestContext(
        request_id=request_id,
        route=route,
        principal=principal,
        routing_key=routing_key,
        metrics=state.metrics,
        wire=wire,
    )
    setattr(request.state, REQUEST_CONTEXT, ctx)
    return ctx


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; decoded once per request (traffic control may have decoded it already
    to estimate its tokens, `DECODED_BODY`), in a thread when large."""
    decoded = request.scope.get("state", {}).pop(DECODED_BODY, None)
    if decoded is not None:
        if _declared_size(request) <= LOOP_BODY_BYTES:
            return json_object(decoded)
        return await anyio.to_thread.run_sync(json_object, decoded)
    body = await request.body()
    if len(body) <= LOOP_BODY_BYTES:
        return decode_json_object(body)
    return await anyio.to_thread.run_sync(decode_json_object, body)


def decode_json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    return json_object(data)


def json_object(data: Any) -> dict[str, Any]:
    """`data` when it is a JSON object nested at most MAX_JSON_DEPTH deep; InvalidRequest otherwise."""
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    check_depth(data)
    return data


def _declared_size(request: Request) -> int:
    size = request.headers.get("content-length", "")
    return int(size) if size.isdigit() else LOOP_BODY_BYTES + 1


async def validate_body(schema: type[BaseModel], body: dict[str, Any], request: Request) -> Any:
    """`schema.model_validate(body)`, in a thread for a large body (see LOOP_BODY_BYTES)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > LOOP_BODY_BYTES:
        return await anyio.to_thread.run_sync(schema.model_validate, body)
    return schema.model_validate(body)


def check_depth(data: Any) -> None:
    """Raises InvalidRequest naming the first value nested deeper than MAX_JSON_DEPTH."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(data, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(
                f"the request body nests deeper than {MAX_JSON_DEPTH} levels", param=param_from_loc(path)
            )
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend(
            (inner, depth + 1, (*path, key)) for key, inner in items if isinstance(inner, dict | list)
        )


def json_response(data: Any, ctx: RequestContext | None = None, status: int = 200) -> Response:
    headers = context_headers(ctx) if ctx is not None else None
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


def context_headers(ctx: RequestContext) -> dict[str, str]:
    """The request id as the request's wire names it (`x-request-id`; `request-id` too on Anthropic's),
    `x-worker`: the id of the worker that served the request (as listed by /v1/workers), which the
    playground shows under each turn, and `x-reasoning-truncated` when a reasoning budget cut the
    analysis (known by the time a JSON body is written)."""
    headers = ctx.wire.id_headers(ctx.request_id)
    if ctx.worker is not None:
        headers["x-worker"] = ctx.worker.id
    if budget_exceeded(ctx):
        headers["x-reasoning-truncated"] = "true"
    return headers


class EventStreamResponse(Response):
    """An SSE body written by one task that reads the engine, frames and writes each piece at once; the
    request's task waits for the client to leave meanwhile. On every exit the body and the request's
    `cleanups` are closed, shielded and bounded (Starlette never closes a body that did not start), and
    the request is logged once.

    At one engine message per token the per-message path is most of the gateway's work, so it is kept
    short: no hand-off to another task per piece, and the writing task's own stack is shallow (every
    frame of a task's stack is resumed and suspended again on each message). uvicorn speaks ASGI 2.3,
    where a write to a client that left is dropped silently: the request's task, listening for
    `http.disconnect`, cancels the writer then, which closes the body and aborts the engine request.
    This is Starlette's `StreamingResponse` with plain asyncio in place of an anyio task group."""

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncGenerator[bytes, None], ctx: RequestContext, headers: dict[str, str]
    ) -> None:
        self.body_iterator = content
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self._ctx = ctx

    async def _write(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        ctx = self._ctx
        async for piece in self.body_iterator:
            # What the client got is numbered here: a cut stream's error event follows it (`Wire`).
            ctx.sent_sequence = ctx.next_sequence
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        finish_request(self._ctx)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        listener = asyncio.current_task()
        assert listener is not None
        listening = True
        writer_ended = False

        def end_listening(_: object) -> None:
            nonlocal writer_ended
            if listening:
                writer_ended = True
                listener.cancel()

        writer = asyncio.create_task(self._write(send))
        writer.add_done_callback(end_listening)
        try:
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
                listening = False
                writer.cancel()  # the client left
                if self._ctx.status < 400:  # a failure it left after stays the request's status
                    self._ctx.status = CLIENT_CLOSED
            except asyncio.CancelledError:
                listening = False
                if not writer_ended or listener.uncancel() > 0:
                    # Cancelled from outside (shutdown, drain): the writer stops too, and the request
                    # ends as its wire answers a gateway shutting down.
                    if self._ctx.status < 400:
                        self._ctx.status = self._ctx.wire.error_response(SHUTTING_DOWN)[0]
                    raise
            if not writer.done():
                await asyncio.wait((writer,))
            if not writer.cancelled():
                writer.result()  # the body's failure, if any
        finally:
            listening = False
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT):
                if not writer.done():
                    writer.cancel()
                    await asyncio.wait((writer,))
                await self.body_iterator.aclose()
            await run_cleanups(self._ctx)
            finish_request(self._ctx)


def sse_response(stream: AsyncGenerator[bytes, None], ctx: RequestContext) -> Response:
    return EventStreamResponse(stream, ctx, {**SSE_HEADERS, **context_headers(ctx)})


async def run_logged(ctx: RequestContext, coro: Any) -> Any:
    """`coro`'s result; a failure (an unexpected one too, as a 500) is recorded and logged as the
    request's end, with the status its wire answers (Anthropic's 529 for an overloaded gateway), before
    it propagates to the error handlers."""
    try:
        return await coro
    except BaseException as exc:
        if is_failure(exc):
            if isinstance(exc, ClientDisconnect):
                ctx.status = CLIENT_CLOSED  # left while sending its body: answered with nothing
            else:
                if isinstance(exc, ValidationError):
                    exc = validation_error_to_invalid(exc)
                ctx.status = ctx.wire.error_response(exc)[0]
            finish_request(ctx)
        raise


async def serve_surface(request: Request, surface: Surface) -> Response:
    """The one endpoint of every generating route: context on the surface's wire, body, validation, the
    surface's plan answered by the driver, then a JSON body (a dict or list) or an SSE stream. Errors
    propagate to the app's handlers, which answer them on the request's wire. The surface's
    `prompt_fields` are logged only with --log-prompts."""
    state = gateway(request)
    ctx = new_context(request, surface.name, state, wire=surface.wire)
    result = await run_logged(ctx, _planned_answer(request, state, surface, ctx))
    if isinstance(result, (dict, list)):
        finish_request(ctx)
        return json_response(result, ctx)
    return sse_response(result, ctx)


async def _planned_answer(
    request: Request, state: GatewayState, surface: Surface, ctx: RequestContext
) -> Any:
    body = await json_body(request)
    asked = ctx.requested_model = requested_model(body)
    if asked in state.fleet.groups:
        ctx.model = asked  # a served model: its name labels the request's metrics, a failure's too
    if state.settings.log_prompts:
        for field in surface.prompt_fields:
            if body.get(field) is not None:
                ctx.log_extra[field] = body[field]
                tracing.annotate_prompt(field, body[field])
    validated = await validate_body(surface.request, body, request)
    return await answer(ctx, await surface.plan(state, validated, ctx))


def surface_endpoint(surface: Surface) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await serve_surface(request, surface)

    endpoint.__name__ = f"create_{surface.name}"
    return endpoint


#: The generating routes, one per row of the surface table (called straight from the ASGI stack by
#: `api/direct_routes.py`; registered here for every other method and for the OpenAPI spec).
surface_router = APIRouter()
for _surface in SURFACES:
    surface_router.add_api_route(
        _surface.path,
        surface_endpoint(_surface),
        methods=["POST"],
        name=_surface.name,
        summary=_surface.summary,
    )


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = gateway(request)
    owner_of(state, request)
    created = int(state.fleet.started_at)
    data = [
        {"id": group.name, "object": "model", "created": created, "owned_by": "harmony-gateway"}
        for group in state.fleet.groups.values()
    ]
    return json_response({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    state = gateway(request)
    owner_of(state, request)
    group = state.fleet.group(model_id)
    created = int(state.fleet.started_at)
    return json_response(
        {"id": group.name, "object": "model", "created": created, "owned_by": "harmony-gateway"}
    )


@router.get("/health")
async def health() -> Response:
    return json_response({"status": "ok"})


@router.get("/readiness")
async def readiness(request: Request) -> Response:
    state = gateway(request)
    if not state.fleet.ready():
        raise NoHealthyWorker("no healthy worker is available")
    return json_response({"status": "ready", "models": sorted(state.fleet.groups)})
