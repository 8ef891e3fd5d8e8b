"""HttpMiddleware: HTTP requests reach the middleware's own handling; every other scope passes through."""

from __future__ import annotations

from starlette.types import Message, Receive, Scope, Send

from harmony_gateway.asgi import HttpMiddleware


class Recording(HttpMiddleware):
    handled: list[str]

    async def handle_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.handled.append(scope["path"])
        await self.app(scope, receive, send)


async def test_http_goes_to_handle_http_and_other_scopes_straight_to_the_app() -> None:
    reached: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append(scope["type"])

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    async def send(message: Message) -> None:
        return None

    middleware = Recording(app)
    middleware.handled = []
    await middleware({"type": "lifespan"}, receive, send)
    await middleware({"type": "http", "path": "/v1/models"}, receive, send)
    assert reached == ["lifespan", "http"]
    assert middleware.handled == ["/v1/models"]
