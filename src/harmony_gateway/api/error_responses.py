"""The one mapping from exceptions to OpenAI-style error responses (REFERENCE §8).

`GatewayError` → its status and `{"error": {message, type, param, code}}`; request validation errors →
400 with `param` naming the field; anything else (a gateway bug, a dependency's failure or panic) → 500
with the request id in the body and `x-should-retry: false` (it will not heal on retry), and one log
line (`UnexpectedErrorMiddleware`). Every response carries `x-request-id`.
"""

from __future__ import annotations

import logging
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

from ..errors import (
    GatewayError,
    InvalidRequest,
    NoHealthyWorker,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    UpstreamUnavailable,
    is_failure,
)
from ..observability.logging import log_failure

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


def gateway_error_response(request: Request, exc: GatewayError) -> Response:
    headers: dict[str, str] = {}
    if isinstance(exc, (RateLimited, NoHealthyWorker, UpstreamUnavailable)):
        headers["retry-after"] = "1"
    if exc.status_code < 500 or exc.status_code == 501:
        headers["x-should-retry"] = "false"
    if isinstance(exc, (RequestTimeout, PayloadTooLarge)):
        headers["connection"] = "close"  # the rest of the body may still be on the wire
    if exc.status_code >= 500:
        log.warning("request %s failed: %s", request_id_of(request), exc.message)
    return error_response(request, exc.status_code, exc.to_dict(), headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError) -> Response:
        return gateway_error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return gateway_error_response(request, validation_error_to_invalid(exc))

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError) -> Response:
        return gateway_error_response(request, validation_error_to_invalid(exc))

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
        # The client left before its body arrived: nothing to answer and nothing broken.
        log.info(
            "client left during the request body of %s %s (request %s)",
            request.method,
            request.url.path,
            request_id_of(request),
        )
        return Response(status_code=499)


def internal_error_body(request_id: str) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": f"internal error (request id {request_id})",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
        }
    )


class UnexpectedErrorMiddleware:
    """Pure ASGI, just inside the request-id middleware: what a request raises that no handler took (a
    gateway bug, a dependency's failure, a Rust extension's panic, which derives from BaseException and
    so passes Starlette's server-error middleware) becomes one log line and, if the response has not
    started, a 500 with the request id. Nothing is re-raised: the server would log the traceback again.
    A response already under way is ended where it stands (its stream has no terminal frame: the
    stages that stream write that themselves, see pipeline/drive.py)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False

        # Hands on `send`'s own awaitable: no frame of its own for every streamed piece.
        def tracking_send(message: Message) -> Awaitable[None]:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
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
            if not started:
                response = Response(
                    internal_error_body(request_id),
                    status_code=500,
                    media_type="application/json",
                    headers={"x-request-id": request_id, "x-should-retry": "false"},
                )
                await response(scope, receive, send)
            elif not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
