"""The prompt inspector (`POST /v1/harmony/render`, `POST /v1/harmony/parse`) and the playground page
(`GET /`, `GET /playground`, its files under `/playground/static/`, and `/favicon.ico`, which browsers ask
every origin for), served from the package's `static/` folder: plain HTML, CSS and JavaScript, no CDN and
no build step, so it works offline.

The inspector routes authenticate and read their bodies like every generating route (`new_context`,
`json_body`), and run the prepare stage as the owner of the key, so a stored response of another key is
a 404 here too. A render shows the worker fleet only to a request holding the admin credential
(`is_admin`, the one `/workers` asks for), which may also render without a tenant key, as no tenant.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import anyio
from fastapi import APIRouter, Request
from starlette.responses import Response

from ..errors import NotFound
from ..observability.metrics import finish_request
from ..pipeline.context import GatewayState
from .admin import is_admin
from .inspect import parse_output, render_request
from .routes import gateway, json_body, json_response, new_context, run_logged

router = APIRouter()

#: File name → media type: the only files the playground serves (no directory listing, no traversal).
STATIC_FILES = {
    "playground.css": "text/css; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
}
#: The page may load only its own files and call only its own gateway.
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def _static(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


@router.get("/")
@router.get("/playground")
async def playground() -> Response:
    return Response(_static("playground.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    return Response(
        _static("favicon.ico"),
        media_type="image/x-icon",
        headers={"cache-control": "public, max-age=86400", "x-content-type-options": "nosniff"},
    )


@router.get("/playground/static/{name}")
async def playground_file(name: str) -> Response:
    media_type = STATIC_FILES.get(name)
    if media_type is None:
        raise NotFound(f"no playground file named {name!r}")
    return Response(_static(name), media_type=media_type, headers=PAGE_HEADERS)


@router.post("/v1/harmony/render")
async def harmony_render(request: Request) -> Response:
    state = gateway(request)
    admin = is_admin(state.settings, request)
    ctx = new_context(request, "harmony_render", state, admin=admin)
    body = await json_body(request)
    rendering = render_request(state, body.get("api"), body.get("request"), ctx, fleet=admin)
    result = await run_logged(ctx, rendering)
    finish_request(ctx)
    return json_response(result, ctx)


@router.post("/v1/harmony/parse")
async def harmony_parse(request: Request) -> Response:
    state = gateway(request)
    ctx = new_context(request, "harmony_parse", state)
    body = await json_body(request)
    result = await run_logged(ctx, _parse(state, body))
    finish_request(ctx)
    return json_response(result, ctx)


async def _parse(state: GatewayState, body: dict[str, Any]) -> dict[str, Any]:
    # Up to `max_parse_tokens` ids: tens of milliseconds to seconds of CPU, never on the event loop.
    result: dict[str, Any] = await anyio.to_thread.run_sync(parse_output, state, body)
    return result
