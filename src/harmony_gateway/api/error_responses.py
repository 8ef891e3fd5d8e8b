"""The one mapping from exceptions to error responses (REFERENCE §8), on the request's wire (`wire.py`:
OpenAI's body, or Anthropic's on the Messages API).

`GatewayError` → its status and body; request validation errors → 400 with `param` naming the field;
anything else (a gateway bug, a dependency's failure or panic) → 500 with the request id in the body and
`x-should-retry: false` (it will not heal on retry), and one log line (`UnexpectedErrorMiddleware`).
Every response carries `x-request-id` (and `request-id` on Anthropic's wire).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..asgi import HttpMiddleware
from ..errors import (
    GatewayError,
    InternalError,
    InvalidRequest,
    is_failure,
)
from ..observability.logging import CLIENT_CLOSED, log_failure
from ..pipeline.context import RequestContext
from ..traffic.middleware import REQUEST_CONTEXT
from ..traffic.routes import RouteMap
from ..wire import Wire, error_headers
from .accounting import RouteNames, account_request

log = logging.getLogger(__name__)


def request_id_of(request: Request) -> str:
    return getattr(request.state, "request_id", None) or ""


def error_response(
    request: Request, status: int, error: dict[str, Any], headers: dict[str, str] | None = None
) -> Response:
    out_headers = {"x-request-id": request_id_of(request)}
    if headers:
        out_headers.update(headers)
    return Response(
        orjson.dumps({"error": error}), status_code=status, media_type="application/json", headers=out_headers
    )


def wire_of(request: Request, routes: RouteMap) -> Wire:
    """The wire `request` answers on: the one its route set on its context, else its route's."""
    ctx = request.scope.get("state", {}).get(REQUEST_CONTEXT)
    if isinstance(ctx, RequestContext):
        return ctx.wire
    return routes.wire(request.method, request.url.path)


def param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for piece in loc:
        if piece in ("body",):
            continue
        if isinstance(piece, int):
            if parts:
                parts[-1] = f"{parts[-1]}[{piece}]"
            continue
        # pydantic names union members ("str", "list[...]", "function-after[...]"): not fields
        if isinstance(piece, str) and (
            "[" in piece or piece in ("str", "int", "float", "bool", "dict", "list")
        ):
            continue
        parts.append(str(piece))
    return ".".join(parts) or None


def validation_error_to_invalid(exc: ValidationError | RequestValidationError) -> InvalidRequest:
    errors = exc.errors()
    first: Mapping[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = param_from_loc(tuple(first.get("loc", ())))
    message = first.get("msg", "invalid request")
    if message.startswith("Value error, "):  # pydantic's prefix for a validator's own message
        message = message[len("Value error, ") :]
    if param:
        message = f"{message} (at {param})"
    return InvalidRequest(message, param=param)


def gateway_error_response(request: Request, exc: GatewayError, wire: Wire) -> Response:
    """`exc` answered on `wire`: its status, body and headers (`wire.error_headers`)."""
    if exc.status_code >= 500:
        log.warning("request %s failed: %s", request_id_of(request), exc.message)
    status, body = wire.error_body(exc)
    headers = error_headers(wire, exc, request_id_of(request))
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def install_error_handlers(app: FastAPI, routes: RouteMap) -> None:
    """The one mapping from what a route raises to its answer, on the wire of the request (`wire_of`)."""

    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError) -> Response:
        return gateway_error_response(request, exc, wire_of(request, routes))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return gateway_error_response(request, validation_error_to_invalid(exc), wire_of(request, routes))

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError) -> Response:
        return gateway_error_response(request, validation_error_to_invalid(exc), wire_of(request, routes))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        return error_response(
            request,
            exc.status_code,
            {"message": str(exc.detail), "type": error_type, "param": None, "code": code},
        )

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client left before its body arrived: nothing to answer and nothing broken. Its request
        # line says so (status 499, api/accounting.py).
        return Response(status_code=CLIENT_CLOSED)


class UnexpectedErrorMiddleware(HttpMiddleware):
    """Pure ASGI, just inside the request-id middleware: what a request raises that no handler took (a
    gateway bug, a dependency's failure, a Rust extension's panic, which derives from BaseException and
    so passes Starlette's server-error middleware) becomes one log line and, if the response has not
    started, a 500 with the request id. Nothing is re-raised: the server would log the traceback again.
    A response already under way is ended where it stands (its stream has no terminal frame: the
    stages that stream write that themselves, see pipeline/drive.py). Every request is then accounted
    with the status it was answered with (api/accounting.py)."""

    def __init__(self, app: ASGIApp, routes: RouteMap, names: RouteNames | None = None) -> None:
        super().__init__(app)
        self.routes = routes
        self.names = names or RouteNames(())

    async def handle_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        status: int | None = None
        ended = False

        # Hands on `send`'s own awaitable: no frame of its own for every streamed piece.
        def tracking_send(message: Message) -> Awaitable[None]:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            return send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except BaseException as exc:
            if not is_failure(exc):
                raise
            request_id = str(scope.get("state", {}).get("request_id") or "")
            log_failure(log, f"request {request_id} ({scope['method']} {scope['path']})", exc)
            if status is None:
                ctx = scope.get("state", {}).get(REQUEST_CONTEXT)
                wire = (
                    ctx.wire
                    if isinstance(ctx, RequestContext)
                    else self.routes.wire(scope["method"], scope["path"])
                )
                failure = InternalError(f"internal error (request id {request_id})")
                status, body = wire.error_body(failure)
                response = Response(
                    body,
                    status_code=status,
                    media_type="application/json",
                    headers=error_headers(wire, failure, request_id),
                )
                await response(scope, receive, send)
            elif not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            account_request(scope, status, started, self.routes, self.names)
