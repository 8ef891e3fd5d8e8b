"""Anthropic Messages API's helper route, `POST /v1/messages/count_tokens` (`POST /v1/messages`, also
`?beta=true` as Claude Code calls it, is the Messages surface's row in the surface table).

Both answer on Anthropic's wire (`wire.ANTHROPIC`: `{"type":"error","error":{"type","message"}}`, 529
when overloaded), which the app's error handlers read from the route map. Auth accepts `x-api-key` as
well as `Authorization: Bearer`. Every response carries `request-id` (read by the Anthropic SDK) and
`x-request-id`.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from ..surfaces.messages.run import count_message_tokens
from ..surfaces.messages.types import CountTokensRequest
from ..wire import ANTHROPIC
from .error_responses import request_id_of
from .routes import gateway, json_body, owner_of

log = logging.getLogger(__name__)

router = APIRouter()


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    state = gateway(request)
    owner = owner_of(state, request)
    count_request = CountTokensRequest.model_validate(await json_body(request))
    result = await count_message_tokens(state, count_request, owner=owner)
    request_id = request_id_of(request)
    return Response(
        orjson.dumps(result), media_type="application/json", headers=ANTHROPIC.id_headers(request_id)
    )
