"""Responses and Conversations routes: thin handlers over the Responses service (responses/) and the store.
`POST /v1/responses` and `/v1/responses/compact` are rows of the surface table (surfaces/table.py)."""

from __future__ import annotations

import time
from typing import Any, TypedDict, TypeVar

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..errors import InvalidRequest, NotFound
from ..pipeline.context import GatewayState
from ..storage.base import Order, Page, StoredConversation
from ..surfaces.responses.events import stream_stored_events
from ..surfaces.responses.mapper import new_id, normalize_items
from ..surfaces.responses.objects import complete_response
from ..surfaces.responses.service import cancel_response
from ..surfaces.responses.service.input_tokens import count_input_tokens
from ..surfaces.responses.types import (
    ConversationCreate,
    ConversationItemsCreate,
    ConversationUpdate,
    InputTokensRequest,
)
from ..wire import RESPONSES
from .routes import gateway, json_body, json_response, new_context, owner_of, sse_response

router = APIRouter()

Found = TypeVar("Found")


def _caller(request: Request) -> tuple[GatewayState, str]:
    """The app's state and the tenant that owns what the request reads and writes (401 when keys are
    configured and the request has none)."""
    state = gateway(request)
    return state, owner_of(state, request)


def _not_found(kind: str, object_id: str) -> NotFound:
    """The 404 for a response, conversation or item the caller cannot see: absent and another
    tenant's look the same."""
    return NotFound(f"{kind} with id {object_id!r} not found", param=f"{kind.lower()}_id")


def _found(value: Found | None, kind: str, object_id: str) -> Found:
    """`value`, as the store found it for the caller; the 404 `_not_found` when it found nothing."""
    if value is None:
        raise _not_found(kind, object_id)
    return value


def _deleted(deleted: bool, kind: str, object_id: str, object_type: str) -> Response:
    """OpenAI's answer to a delete, or the 404 when the store deleted nothing the caller can see."""
    if not deleted:
        raise _not_found(kind, object_id)
    return json_response({"id": object_id, "object": object_type, "deleted": True})


class PageQuery(TypedDict):
    """A list endpoint's query, as the store's `list_*` methods take it."""

    after: str | None
    limit: int
    order: Order


def _page_query(request: Request) -> PageQuery:
    q = request.query_params
    after = q.get("after") or None
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise InvalidRequest("limit must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise InvalidRequest("limit must be between 1 and 100", param="limit")
    order = q.get("order", "desc")
    if order == "asc":
        return PageQuery(after=after, limit=limit, order="asc")
    if order == "desc":
        return PageQuery(after=after, limit=limit, order="desc")
    raise InvalidRequest("order must be 'asc' or 'desc'", param="order")


def _list_body(page: Page) -> dict[str, Any]:
    return {
        "object": "list",
        "data": page.data,
        "first_id": page.first_id,
        "last_id": page.last_id,
        "has_more": page.has_more,
    }


def _starting_after(request: Request) -> int:
    raw = request.query_params.get("starting_after")
    if raw is None or raw == "":
        return -1
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest("starting_after must be an integer", param="starting_after") from None
    if value < -1:
        raise InvalidRequest("starting_after must be -1 or more", param="starting_after")
    return value


@router.post("/v1/responses/input_tokens")
async def input_tokens(request: Request) -> Response:
    """The prompt tokens a `POST /v1/responses` with this body would send (OpenAI's token counts)."""
    state = gateway(request)
    ctx = new_context(request, "responses_input_tokens", state, wire=RESPONSES)
    body = InputTokensRequest.model_validate(await json_body(request))
    return json_response(await count_input_tokens(state, body, ctx), ctx)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    """The stored Response; with `stream=true`, its events after `starting_after` (background only)."""
    state, owner = _caller(request)
    stream = request.query_params.get("stream", "").lower() in ("true", "1")
    after = _starting_after(request) if stream else -1
    record = _found(await state.store.get_response(response_id, owner), "Response", response_id)
    if not stream:
        return json_response(complete_response(record.response))
    if not record.background:
        # Only background responses keep an event log (OpenAI answers 400 here too).
        raise InvalidRequest(
            "Only background responses can be streamed; create it with background=true.", param="stream"
        )
    ctx = new_context(request, "responses_stream", state, wire=RESPONSES)
    ctx.model = record.model
    events = stream_stored_events(
        state.store,
        response_id,
        owner,
        after,
        state.background.feed(response_id),
        ctx,
        idle_timeout=state.settings.timeouts.first_token,
    )
    return sse_response(events, ctx)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    state, owner = _caller(request)
    return _deleted(
        await state.store.delete_response(response_id, owner), "Response", response_id, "response"
    )


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, request: Request) -> Response:
    state, owner = _caller(request)
    return json_response(await cancel_response(state, response_id, owner))


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request) -> Response:
    state, owner = _caller(request)
    page = await state.store.list_input_items(response_id, owner, **_page_query(request))
    return json_response(_list_body(_found(page, "Response", response_id)))


# -- conversations -----------------------------------------------------------------------------------
def _conversation_body(conv: StoredConversation) -> dict[str, Any]:
    return {"id": conv.id, "object": "conversation", "created_at": conv.created_at, "metadata": conv.metadata}


@router.post("/v1/conversations")
async def create_conversation(request: Request) -> Response:
    state, owner = _caller(request)
    req = ConversationCreate.model_validate(await json_body(request))
    items = normalize_items(req.items or [], param="items", references=False)
    conv = StoredConversation(
        id=new_id("conv"), owner=owner, created_at=int(time.time()), metadata=req.metadata or {}
    )
    await state.store.create_conversation(conv, items, limits=state.settings.conversation_limits)
    return json_response(_conversation_body(conv))


async def _conversation(state: GatewayState, conversation_id: str, owner: str) -> StoredConversation:
    conv = await state.store.get_conversation(conversation_id, owner)
    return _found(conv, "Conversation", conversation_id)


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, request: Request) -> Response:
    state, owner = _caller(request)
    return json_response(_conversation_body(await _conversation(state, conversation_id, owner)))


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(conversation_id: str, request: Request) -> Response:
    state, owner = _caller(request)
    req = ConversationUpdate.model_validate(await json_body(request))
    # `null` clears the metadata, as `{}` does.
    conv = await state.store.update_conversation_metadata(conversation_id, owner, req.metadata or {})
    return json_response(_conversation_body(_found(conv, "Conversation", conversation_id)))


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    state, owner = _caller(request)
    return _deleted(
        await state.store.delete_conversation(conversation_id, owner),
        "Conversation",
        conversation_id,
        "conversation.deleted",
    )


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(conversation_id: str, request: Request) -> Response:
    state, owner = _caller(request)
    page = await state.store.list_conversation_items(conversation_id, owner, **_page_query(request))
    return json_response(_list_body(_found(page, "Conversation", conversation_id)))


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, request: Request) -> Response:
    state, owner = _caller(request)
    req = ConversationItemsCreate.model_validate(await json_body(request))
    items = normalize_items(req.items, param="items", references=False)
    added = await state.store.add_conversation_items(
        conversation_id, owner, items, limits=state.settings.conversation_limits
    )
    data = [entry.item for entry in _found(added, "Conversation", conversation_id)]
    return json_response(
        _list_body(Page(data, has_more=False, first_id=data[0]["id"], last_id=data[-1]["id"]))
    )


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, request: Request) -> Response:
    state, owner = _caller(request)
    await _conversation(state, conversation_id, owner)
    entry = await state.store.get_conversation_item(conversation_id, item_id, owner)
    return json_response(_found(entry, "Item", item_id).item)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request) -> Response:
    state, owner = _caller(request)
    conv = await _conversation(state, conversation_id, owner)
    if not await state.store.delete_conversation_item(conversation_id, item_id, owner):
        raise _not_found("Item", item_id)
    return json_response(_conversation_body(conv))
