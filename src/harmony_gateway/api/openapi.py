"""The OpenAPI document at /openapi.json (and the Swagger page at /docs), describing what really happens.

The generating and storing routes read raw JSON (api/routes.py `json_body`: depth check, one error
mapping), so FastAPI cannot see their request models; `REQUEST_BODIES` names them and they are added as
`requestBody` schemas. Every operation lists the OpenAI error object under each error status the gateway
answers with (FastAPI's default 422 is dropped: validation errors are 400s). With `--protect-metrics` both
pages need the admin credential (api/admin.py); the Swagger page then fetches the spec without it, so read
it on the admin listener or fetch /openapi.json with the key.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, JsonValue
from starlette.responses import HTMLResponse, Response

from ..surfaces.messages.types import CountTokensRequest
from ..surfaces.responses.types import (
    ConversationCreate,
    ConversationItemsCreate,
    ConversationUpdate,
    InputTokensRequest,
)
from ..surfaces.table import SURFACES
from .admin import require_admin
from .inspect import INSPECTABLE
from .routes import gateway, json_response


class WorkerRegistration(BaseModel):
    """`POST /workers`: a worker to add (api/workers.py)."""

    model_config = ConfigDict(extra="allow")

    url: str = Field(description="grpc://host:port, or http://host:port for an OpenAI-compatible server")
    kind: str = Field("regular", description="regular, prefill or decode")
    engine: str | None = Field(None, description="sglang, vllm or auto (default: the gateway's --engine)")


class RenderRequest(BaseModel):
    """`POST /v1/harmony/render`: a request to render, as the named API would receive it."""

    model_config = ConfigDict(extra="allow")

    api: str = Field(
        description="the API the request is for",
        json_schema_extra={"enum": list[JsonValue](sorted(INSPECTABLE))},
    )
    request: dict[str, Any] = Field(description="the request body that API would receive")


class ParseRequest(BaseModel):
    """`POST /v1/harmony/parse`: completion tokens or text to parse as Harmony (exactly one of them)."""

    model_config = ConfigDict(extra="allow")

    token_ids: list[int] | None = None
    text: str | None = None


REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    **{("post", surface.path): surface.request for surface in SURFACES},
    ("post", "/v1/conversations"): ConversationCreate,
    ("post", "/v1/conversations/{conversation_id}"): ConversationUpdate,
    ("post", "/v1/conversations/{conversation_id}/items"): ConversationItemsCreate,
    ("post", "/v1/messages/count_tokens"): CountTokensRequest,
    ("post", "/v1/responses/input_tokens"): InputTokensRequest,
    ("post", "/v1/harmony/render"): RenderRequest,
    ("post", "/v1/harmony/parse"): ParseRequest,
    ("post", "/workers"): WorkerRegistration,
}

#: Routes answering with a stream when asked (`stream: true`).
STREAMING = {*(surface.path for surface in SURFACES if surface.streams), "/v1/responses/{response_id}"}
#: Success statuses other than 200, and non-JSON success bodies.
SUCCESS_STATUS = {("post", "/workers"): "201"}
SUCCESS_MEDIA = {
    "/": "text/html",
    "/playground": "text/html",
    "/playground/static/{name}": "*/*",
    "/metrics": "text/plain",
}

ERROR_STATUSES = {
    "400": "Invalid request (`param` names the field)",
    "401": "Missing or unknown API key",
    "403": "A key that may not use this route (the admin plane), or the admin plane is off",
    "404": "No such object, route or model",
    "408": "The request headers or body arrived too slowly",
    "409": "The request conflicts with an object's state",
    "413": "The request body or headers are too large",
    "424": "A request-declared MCP server could not be used",
    "429": "Admission control refused the request; retry later",
    "502": "The engine misbehaved",
    "503": "No healthy worker, or the engine is unavailable",
    "504": "The engine did not answer in time",
}

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


#: One server-sent event as a client's SSE parser yields it (each `data` is a JSON document or `[DONE]`).
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["Error"] = ERROR_SCHEMA
    error_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for path, operations in spec.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            success = SUCCESS_STATUS.get((method, path))
            if success is not None and "200" in responses:
                responses[success] = responses.pop("200")
            ok = responses.get(success or "200")
            if ok is not None:
                media = SUCCESS_MEDIA.get(path)
                if media is not None:
                    ok["content"] = {media: {}}
                elif path in STREAMING:
                    ok.setdefault("content", {"application/json": {"schema": {}}})
                    ok["content"]["text/event-stream"] = {"schema": SSE_EVENT_SCHEMA}
            for status, description in ERROR_STATUSES.items():
                responses.setdefault(status, {"description": description, "content": error_ref})
            model = REQUEST_BODIES.get((method, path))
            if model is not None:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, definition in schema.pop("$defs", {}).items():
                    schemas.setdefault(name, definition)
                schemas.setdefault(model.__name__, schema)
                operation["requestBody"] = {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
                    },
                }
    return spec


def install_openapi(app: FastAPI) -> None:
    """Serve /openapi.json and /docs (the app is built with both FastAPI defaults off)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    async def openapi_json(request: Request) -> Response:
        state = gateway(request)
        if state.settings.protect_metrics:
            require_admin(state.settings, request)
        return json_response(openapi())

    async def docs(request: Request) -> Response:
        state = gateway(request)
        if state.settings.protect_metrics:
            require_admin(state.settings, request)
        page: HTMLResponse = get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")
        return page

    app.add_api_route("/openapi.json", openapi_json, methods=["GET"], include_in_schema=False)
    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)
