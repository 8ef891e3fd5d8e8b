"""The surface table is the only list of API surfaces: every row is routed (through the direct ASGI
path too), documented in the OpenAPI spec with its request body and streaming, under traffic control
at a generation's cost on its own wire, offered by the inspector when it can be inspected, and run
through the driver's contract tests. A new row is picked up by all of them, or this test names the
one that missed it."""

from __future__ import annotations

from typing import Any

import pytest

from harmony_gateway.api.direct_routes import DirectRoutes
from harmony_gateway.api.inspect import INSPECTABLE
from harmony_gateway.app import create_app
from harmony_gateway.errors import NoHealthyWorker
from harmony_gateway.settings import Settings
from harmony_gateway.surfaces.table import SURFACES, Surface, route_map
from harmony_gateway.traffic.middleware import TrafficMiddleware
from harmony_gateway.traffic.routes import GENERATION
from tests.e2e import test_driver_contract as contract
from tests.traffic.test_route_control import app_routes

ROWS = [pytest.param(surface, id=surface.name) for surface in SURFACES]


@pytest.fixture(scope="module")
def app() -> Any:
    return create_app(Settings())


def _middleware_option(app: Any, cls: type, name: str) -> Any:
    [middleware] = [m for m in app.user_middleware if m.cls is cls]
    return middleware.kwargs[name]


def test_names_and_paths_are_unique() -> None:
    assert len({s.name for s in SURFACES}) == len({s.path for s in SURFACES}) == len(SURFACES)


@pytest.mark.parametrize("surface", ROWS)
def test_a_row_is_routed(app: Any, surface: Surface) -> None:
    assert ("POST", surface.path) in app_routes()
    # ...and called straight from the ASGI stack, past FastAPI's router.
    assert surface.path in _middleware_option(app, DirectRoutes, "routes")


@pytest.mark.parametrize("surface", ROWS)
def test_a_row_is_documented(app: Any, surface: Surface) -> None:
    operation = app.openapi()["paths"][surface.path]["post"]
    assert operation["summary"] == surface.summary
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert schema["$ref"].endswith("/" + surface.request.__name__)
    assert ("text/event-stream" in operation["responses"]["200"]["content"]) == surface.streams


@pytest.mark.parametrize("surface", ROWS)
def test_a_row_is_under_traffic_control_on_its_wire(app: Any, surface: Surface) -> None:
    routes = _middleware_option(app, TrafficMiddleware, "routes")
    assert routes == route_map()
    assert routes.cost("POST", surface.path) is GENERATION
    assert routes.wire("POST", surface.path) is surface.wire
    for method, path in surface.also:
        assert routes.wire(method, path) is surface.wire


@pytest.mark.parametrize("surface", ROWS)
def test_a_row_is_inspectable_when_it_says_so(surface: Surface) -> None:
    assert (surface.name in INSPECTABLE) == (surface.inspect is not None)


@pytest.mark.parametrize("surface", ROWS)
def test_a_row_runs_through_the_driver_contract_tests(surface: Surface) -> None:
    [case] = [case for case in contract.SURFACES if case.name == surface.name]
    assert case.path == surface.path
    assert case.route == surface.name
    assert case.streams == surface.streams
    # The contract's expected statuses are the wire's own.
    overloaded = surface.wire.error_response(NoHealthyWorker("no worker"))[0]
    assert case.status(503) == overloaded
