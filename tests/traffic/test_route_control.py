"""Every route is under traffic control unless it is in the reviewed opt-out list: walked from the
app's own route table, so a route added later is covered by default."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
from fastapi.routing import APIRoute

from harmony_gateway.app import create_app
from harmony_gateway.settings import Settings
from harmony_gateway.surfaces.table import SURFACES, route_map
from harmony_gateway.traffic.routes import (
    GENERATION,
    READ,
    RELEASE,
    ROUTE_COSTS,
    TOKENIZING,
    UNCONTROLLED,
    WRITE,
    route_cost,
)
from tests.traffic._support import chat_body, sim_and_gateway


def _api_routes(routes: Any) -> Iterator[APIRoute]:
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        inner = getattr(route, "original_router", None)  # an included router
        if inner is not None:
            yield from _api_routes(inner.routes)


def app_routes() -> list[tuple[str, str]]:
    """(method, path template) of every route the app serves."""
    app = create_app(Settings())
    return sorted(
        {(method, route.path) for route in _api_routes(app.router.routes) for method in route.methods or ()}
    )


def concrete(template: str) -> str:
    """A path that matches `template`, its parameters filled in."""
    return re.sub(r"\{[^}]+\}", "x", template)


def test_every_route_is_controlled_or_explicitly_opted_out() -> None:
    routes = app_routes()
    assert ("POST", "/v1/harmony/render") in routes and ("POST", "/v1/conversations") in routes
    route_costs = route_map()
    for method, template in routes:
        cost = route_costs.cost(method, concrete(template))
        if (method, template) in UNCONTROLLED:
            assert cost is None, (method, template)
        else:
            assert cost is not None, (method, template)
            assert cost.requests > 0, (method, template)
    # The opt-out list and the cost table name only routes that exist.
    assert set(UNCONTROLLED) <= set(routes)
    assert set(ROUTE_COSTS) <= set(routes)


def test_route_weights() -> None:
    for surface in SURFACES:
        assert route_map().cost("POST", surface.path) is GENERATION
    assert route_cost("POST", "/v1/harmony/render") is TOKENIZING
    assert route_cost("POST", "/v1/messages/count_tokens") is TOKENIZING
    assert route_cost("POST", "/v1/conversations/conv_1/items") is WRITE
    assert route_cost("GET", "/v1/responses/resp_1") is READ
    assert route_cost("DELETE", "/v1/conversations/conv_1") is RELEASE
    assert route_cost("POST", "/v1/responses/resp_1/cancel") is RELEASE and not RELEASE.admission
    assert route_cost("HEAD", "/v1/models") is READ
    assert route_cost("GET", "/playground/static/app.js") is None
    # Heavier with a bigger input.
    assert TOKENIZING.weight(4 * 1024 * 1024) > TOKENIZING.weight(1024) >= 1
    assert READ.weight(0) < 1 and not READ.admission


async def test_a_spent_budget_refuses_every_controlled_route() -> None:
    """One request a minute per address: after one chat, every controlled route answers 429 (render,
    parse, count_tokens and conversation writes used to run regardless), the opted-out ones answer."""
    async with sim_and_gateway(rate_limit=1) as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            spent = await http.post("/v1/chat/completions", json=chat_body(stream=False))
            assert spent.status_code == 200
            for method, template in app_routes():
                r = await http.request(method, concrete(template), json={} if method == "POST" else None)
                if (method, template) in UNCONTROLLED:
                    assert r.status_code != 429, (method, template)
                else:
                    assert r.status_code == 429, (method, template, r.status_code, r.text)
                    assert int(r.headers["retry-after"]) >= 1


async def test_render_and_parse_take_admission_slots() -> None:
    """With one slot held by a running stream and no queue, a render is refused `queue_full`."""
    from harmony_gateway.sim import SimConfig

    async with sim_and_gateway(
        SimConfig(port=0, tokens_per_second=20), max_concurrent_requests=1, queue_size=0
    ) as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json=chat_body("[[long]]")) as running:
                assert running.status_code == 200
                render = await http.post(
                    "/v1/harmony/render", json={"api": "chat", "request": chat_body(stream=False)}
                )
                parse = await http.post("/v1/harmony/parse", json={"text": "hi"})
                models = await http.get("/v1/models")
            assert render.status_code == parse.status_code == 429
            assert render.json()["error"]["code"] == "queue_full"
            assert models.status_code == 200  # reads take no slot
