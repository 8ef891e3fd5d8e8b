"""The end of every request, accounted once: one line on `harmony_gateway.requests` and one count in
`gateway_requests_total`, whatever its status.

A route that makes a `RequestContext` records its request itself (`finish_request`: worker, tokens,
first token). Whatever it did not record is recorded here when the request's response has ended
(`UnexpectedErrorMiddleware` calls `account_request`): a refusal before any route ran (401, 413, 429, a
draining gateway's 503), a route that failed before making its context, a route that makes none (stored
responses, conversations, models), a path no route serves, and a client that left with nothing sent
(`CLIENT_CLOSED`). Probes, `/metrics` and the playground's files (`traffic.routes.UNCONTROLLED`) are
not accounted: orchestrators and scrapers call them on a schedule.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import APIRouter
from starlette.datastructures import Headers
from starlette.routing import Match, Route
from starlette.types import Scope

from ..observability.logging import CLIENT_CLOSED
from ..observability.metrics import finish_request
from ..pipeline.context import RequestContext
from ..principal import ANONYMOUS, Principal, authenticate
from ..traffic.middleware import REQUEST_CONTEXT
from ..traffic.routes import RouteMap

#: The `route` of a request for a path no route serves.
UNMATCHED = "unmatched"


class RouteNames:
    """The names of the app's routes, for the `route` label of a request no route recorded: the
    surface's name for a generating route, else the endpoint's; `UNMATCHED` for a path no route serves.
    One value per route, whatever the path says, so the label stays bounded."""

    def __init__(self, routers: Iterable[APIRouter]) -> None:
        self._routes = [route for router in routers for route in router.routes if isinstance(route, Route)]

    def of(self, scope: Scope) -> str:
        # The router leaves the route it chose in the scope; a request refused before routing, or
        # answered by a generating route past the router (api/direct_routes.py), is matched here.
        name = getattr(scope.get("route"), "name", None)
        if isinstance(name, str) and name:
            return name
        for route in self._routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return route.name
        return UNMATCHED


def account_request(
    scope: Scope, status: int | None, started: float, routes: RouteMap, names: RouteNames
) -> None:
    """Record the request of `scope`, answered with `status` (None: nothing was sent, the client left),
    unless its route recorded it already. `started`: `time.perf_counter()` when it arrived."""
    state = scope.get("state") or {}
    ctx = state.get(REQUEST_CONTEXT)
    if isinstance(ctx, RequestContext):
        if not ctx.finished:
            ctx.status = status or CLIENT_CLOSED
            finish_request(ctx)
        return
    if routes.cost(scope["method"], scope["path"]) is None:
        return
    gateway = getattr(getattr(scope.get("app"), "state", None), "gateway", None)
    principal = state.get("principal")
    if not isinstance(principal, Principal):
        # Refused before its key was looked at (a body over --max-body-bytes): look now, so the line
        # names the key it came with when that key is valid.
        found = authenticate(gateway.settings, Headers(scope=scope)) if gateway is not None else None
        principal = found or ANONYMOUS
    finish_request(
        RequestContext(
            request_id=str(state.get("request_id") or ""),
            route=names.of(scope),
            principal=principal,
            started=started,
            status=status or CLIENT_CLOSED,
            metrics=gateway.metrics if gateway is not None else None,
        )
    )


__all__ = ["UNMATCHED", "RouteNames", "account_request"]
