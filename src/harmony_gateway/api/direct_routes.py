"""The generating routes called straight from the ASGI stack, past FastAPI's router.

A generating POST (a row of the surface table, `surfaces/table.py`) takes a `Request` and parses its own
body, so FastAPI's route matching, dependency solving
and the two exit stacks it opens per request do nothing for it; they cost about 7 % of a non-stream
request's CPU. `DirectRoutes` calls those endpoints itself, with the app's exception handlers, as the
innermost middleware (admission, rate limits, body limits and request ids still apply). The routes stay
registered with FastAPI, which serves every other method and path and documents them in the OpenAPI spec.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any

from starlette._exception_handler import wrap_app_handling_exceptions
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

Endpoint = Callable[[Request], Awaitable[Response]]


def post_endpoints(routers: Iterable[Any], paths: Collection[str]) -> dict[str, Endpoint]:
    """The endpoints the routers register for `POST path`, for each of `paths` (all must be there)."""
    found = {
        route.path: route.endpoint
        for router in routers
        for route in router.routes
        if isinstance(route, Route) and route.path in paths and "POST" in (route.methods or ())
    }
    missing = set(paths) - set(found)
    if missing:
        raise ValueError(f"no POST route registered for {sorted(missing)}")
    return found


class DirectRoutes:
    """Pure ASGI: `POST path` → `routes[path](request)`, errors through the app's exception handlers."""

    def __init__(
        self, app: ASGIApp, routes: Mapping[str, Endpoint], exception_handlers: Mapping[object, object]
    ):
        self.app = app
        self.routes = dict(routes)
        # What Starlette's ExceptionMiddleware hands `wrap_app_handling_exceptions`: by exception class,
        # and by status code for HTTP exceptions. `Exception` (and 500) stay with the server-error
        # middleware outside, as in Starlette's own stack.
        handlers = {k: v for k, v in exception_handlers.items() if k not in (Exception, 500)}
        self.handlers = (
            {k: v for k, v in handlers.items() if not isinstance(k, int)},
            {k: v for k, v in handlers.items() if isinstance(k, int)},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        scope["starlette.exception_handlers"] = self.handlers
        request = Request(scope, receive, send)

        async def run(scope: Scope, receive: Receive, send: Send) -> None:
            response = await endpoint(request)
            await response(scope, receive, send)

        await wrap_app_handling_exceptions(run, request)(scope, receive, send)


__all__ = ["DirectRoutes", "post_endpoints"]
