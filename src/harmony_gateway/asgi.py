"""The shape of the gateway's middlewares: pure ASGI callables that act on HTTP requests only.

`app.py` stacks them around the routes (request id, unexpected errors, the request guard, traffic
control); each one subclasses `HttpMiddleware` and implements `handle_http`, so the lifespan and any
other scope pass straight through to the app they wrap. A leaf: it imports nothing of the gateway.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class HttpMiddleware:
    """Wraps `app`; HTTP requests go to `handle_http`, every other scope (lifespan) straight to `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle_http(scope, receive, send)

    async def handle_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request: answer it, or pass it on to `self.app`."""
        raise NotImplementedError


__all__ = ["HttpMiddleware"]
