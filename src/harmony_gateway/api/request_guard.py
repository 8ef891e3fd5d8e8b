"""Bounds on the request body before any handler parses it: size (`--max-body-bytes`) and pace
(`--body-timeout`).

A pure ASGI middleware: a declared `content-length` over the cap is answered 413 at once, without
reading a byte, in the route's wire's shape (`RouteMap.wire`); a chunked body is counted as it arrives
and refused when it passes the cap; each body read waits at most `body_timeout` seconds for the next
piece (a client trickling its body is answered 408, as nginx's `client_body_timeout` does). Both raise
typed errors from the handler's own `receive`, so the one error mapping (api/error_responses.py) writes
them. Only `receive` is wrapped, and only until the body is complete: responses, streamed ones
included, pass through untouched.
"""

from __future__ import annotations

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..asgi import HttpMiddleware
from ..errors import PayloadTooLarge, RequestTimeout
from ..traffic.routes import RouteMap
from ..wire import error_headers

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 30.0


def too_large_message(limit: int) -> str:
    return f"the request body is larger than this gateway accepts ({limit} bytes; --max-body-bytes)"


class RequestGuardMiddleware(HttpMiddleware):
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        routes: RouteMap | None = None,
    ) -> None:
        super().__init__(app)
        self.routes = routes or RouteMap()
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def handle_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit() or int(value) > limit:
                    await _refuse_too_large(scope, send, limit, self.routes)
                    return
                break
        timeout = self.body_timeout
        received = 0
        body_done = False

        async def guarded_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            with anyio.move_on_after(timeout) as scope_:
                message = await receive()
            if scope_.cancelled_caught:
                raise RequestTimeout(f"the request body did not arrive within {timeout:g} s (--body-timeout)")
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(too_large_message(limit))
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        await self.app(scope, guarded_receive, send)


async def _refuse_too_large(scope: Scope, send: Send, limit: int, routes: RouteMap) -> None:
    wire = routes.wire(scope["method"], scope["path"])
    exc = PayloadTooLarge(too_large_message(limit))
    status, body = wire.error_body(exc)
    # `connection: close` among them: the unread body is still on the wire.
    headers = error_headers(wire, exc, str(scope.get("state", {}).get("request_id") or ""))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *((name.encode(), value.encode()) for name, value in headers.items()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


__all__ = ["DEFAULT_BODY_TIMEOUT", "DEFAULT_MAX_BODY_BYTES", "RequestGuardMiddleware"]
