"""Gives every request an id before any handler runs and puts it on every response as `x-request-id`.

The id is the client's `x-request-id` when it sent one, else a fresh one; handlers read it from
`request.state.request_id` (so the engine, the log and the response agree). A response that already
names an id keeps it.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import Message, Receive, Scope, Send

from ..asgi import HttpMiddleware
from ..pipeline.context import new_request_id

_WELL_FORMED = re.compile(r"[A-Za-z0-9_.:/+=@-]{1,128}")


def accepted_request_id(client_id: str | None) -> str:
    """The client's id when it is well formed, else a fresh one."""
    if client_id and _WELL_FORMED.fullmatch(client_id):
        return client_id
    return new_request_id()


class RequestIdMiddleware(HttpMiddleware):
    async def handle_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = accepted_request_id(Headers(scope=scope).get("x-request-id"))
        scope.setdefault("state", {})["request_id"] = request_id

        # Hands on `send`'s own awaitable: no frame of its own for every streamed piece.
        def send_with_id(message: Message) -> Awaitable[None]:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if "x-request-id" not in headers:
                    headers.append("x-request-id", request_id)
            return send(message)

        await self.app(scope, receive, send_with_id)
