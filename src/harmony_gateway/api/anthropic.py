"""Anthropic Messages API routes: `POST /v1/messages` (also `?beta=true`, as Claude Code calls it) and
`POST /v1/messages/count_tokens`.

Errors on these routes use Anthropic's body `{"type":"error","error":{"type","message"}}` (mapped once, by
`wire.ANTHROPIC`), so they are handled here rather than by the app's OpenAI-shaped
handlers. Auth accepts `x-api-key` as well as `Authorization: Bearer`. Every response carries
`request-id` (read by the Anthropic SDK) and `x-request-id`.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import Response

from ..errors import GatewayError, is_failure
from ..observability import tracing
from ..observability.logging import log_failure
from ..observability.metrics import finish_request
from ..pipeline.context import RequestContext, new_request_id
from ..pipeline.drive import answer
from ..pipeline.reasoning_budget import budget_exceeded
from ..surfaces.messages.run import count_message_tokens, plan_messages
from ..surfaces.messages.types import CountTokensRequest, MessagesRequest
from ..wire import ANTHROPIC
from .error_responses import validation_error_to_invalid
from .routes import gateway, json_body, new_context, owner_of, sse_response

log = logging.getLogger(__name__)

router = APIRouter()


def _ids(ctx: RequestContext | None, request: Request) -> dict[str, str]:
    request_id = (
        ctx.request_id if ctx is not None else getattr(request.state, "request_id", None) or new_request_id()
    )
    return {"request-id": request_id, "x-request-id": request_id}


def _error_response(request: Request, ctx: RequestContext | None, exc: BaseException) -> Response:
    """Anthropic's error response for `exc`; anything but a failure (cancellation) is re-raised."""
    if not is_failure(exc):
        raise exc
    if isinstance(exc, ValidationError):
        exc = validation_error_to_invalid(exc)
    if not isinstance(exc, GatewayError):
        request_id = _ids(ctx, request)["request-id"]
        log_failure(log, f"request {request_id} ({request.url.path})", exc)
    status, body = ANTHROPIC.error_response(exc)
    headers = _ids(ctx, request)
    if status in (429, 529):
        headers["retry-after"] = "1"
    elif status < 500:
        headers["x-should-retry"] = "false"
    if ctx is not None:
        ctx.status = status
        finish_request(ctx)
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    state = gateway(request)
    ctx: RequestContext | None = None
    try:
        ctx = new_context(request, "messages", state, wire=ANTHROPIC)
        body = await json_body(request)
        if state.settings.log_prompts:
            ctx.log_extra["messages"] = body.get("messages")
            tracing.annotate_prompt("messages", body.get("messages"))
        message_request = MessagesRequest.model_validate(body)
        result = await answer(ctx, await plan_messages(state, message_request, ctx))
    except BaseException as exc:  # a dependency's panic too: Anthropic's error body, not the OpenAI one
        return _error_response(request, ctx, exc)
    if isinstance(result, dict):
        finish_request(ctx)
        headers = _ids(ctx, request)
        if budget_exceeded(ctx):
            headers["x-reasoning-truncated"] = "true"
        return Response(orjson.dumps(result), media_type="application/json", headers=headers)
    response = sse_response(result, ctx)
    response.headers["request-id"] = ctx.request_id
    return response


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    state = gateway(request)
    try:
        owner = owner_of(state, request)
        count_request = CountTokensRequest.model_validate(await json_body(request))
        result = await count_message_tokens(state, count_request, owner=owner)
    except BaseException as exc:
        return _error_response(request, None, exc)
    return Response(orjson.dumps(result), media_type="application/json", headers=_ids(None, request))
