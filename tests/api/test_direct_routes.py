"""`DirectRoutes` serves the generating POST routes itself and leaves everything else to the app."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from harmony_gateway.api.direct_routes import DirectRoutes, post_endpoints
from harmony_gateway.api.routes import surface_router
from harmony_gateway.surfaces.table import SURFACES


class Refused(Exception):
    pass


async def direct(request: Request) -> Response:
    body = await request.json()
    if body.get("refuse"):
        raise Refused("no")
    return JSONResponse({"served_by": "direct", "echo": body})


async def routed(request: Request) -> Response:
    return JSONResponse({"served_by": "router", "method": request.method})


async def refused(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": {"message": str(exc)}}, status_code=418)


def client() -> httpx.AsyncClient:
    app = Starlette(
        routes=[
            Route("/v1/thing", routed, methods=["GET", "POST"]),
            Route("/other", routed, methods=["POST"]),
        ],
        exception_handlers={Refused: refused},
    )
    app.add_middleware(DirectRoutes, routes={"/v1/thing": direct}, exception_handlers=app.exception_handlers)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_a_direct_route_is_served_without_the_router() -> None:
    async with client() as http:
        r = await http.post("/v1/thing", json={"a": 1})
    assert r.json() == {"served_by": "direct", "echo": {"a": 1}}


async def test_other_methods_and_paths_go_to_the_router() -> None:
    async with client() as http:
        assert (await http.get("/v1/thing")).json() == {"served_by": "router", "method": "GET"}
        assert (await http.post("/other")).json() == {"served_by": "router", "method": "POST"}


async def test_errors_take_the_apps_exception_handlers() -> None:
    async with client() as http:
        r = await http.post("/v1/thing", json={"refuse": True})
    assert r.status_code == 418 and r.json() == {"error": {"message": "no"}}


def test_the_generating_routes_are_found_on_the_routers() -> None:
    paths = {surface.path for surface in SURFACES}
    found = post_endpoints((surface_router,), paths)
    assert set(found) == paths and found["/v1/responses"].__name__ == "create_responses"
    with pytest.raises(ValueError, match="/v1/nothing"):
        post_endpoints((surface_router,), {"/v1/nothing"})
