"""Responses and Conversations routes: thin handlers over the Responses service (responses/) and the store."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..errors import InvalidRequest, NotFound
from ..storage.base import StoredConversation
from ..surfaces.responses.events import stream_stored_events
from ..surfaces.responses.mapper import new_id, normalize_items
from ..surfaces.responses.service import cancel_response
from ..surfaces.responses.types import (
    ConversationCreate,
    ConversationItemsCreate,
    ConversationUpdate,
)
from ..wire import RESPONSES
from .routes import gateway, json_body, json_response, new_context, owner_of, sse_response

router = APIRouter()


def _page_params(request: Request) -> tuple[str | None, int, Literal["asc", "desc"]]:
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
        return after, limit, "asc"
    if order == "desc":
        return after, limit, "desc"
    raise InvalidRequest("order must be 'asc' or 'desc'", param="order")


def _list_body(page: Any) -> dict[str, Any]:
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


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    """The stored Response; with `stream=true`, its events after `starting_after` (background only)."""
    state = gateway(request)
    owner = owner_of(state, request)
    stream = request.query_params.get("stream", "").lower() in ("true", "1")
    after = _starting_after(request) if stream else -1
    record = await state.store.get_response(response_id, owner)
    if record is None:
        raise NotFound(f"Response with id {response_id!r} not found", param="response_id")
    if not stream:
        return json_response(record.response)
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
    state = gateway(request)
    owner = owner_of(state, request)
    if not await state.store.delete_response(response_id, owner):
        raise NotFound(f"Response with id {response_id!r} not found", param="response_id")
    return json_response({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, request: Request) -> Response:
    state = gateway(request)
    owner = owner_of(state, request)
    return json_response(await cancel_response(state, response_id, owner))


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request) -> Response:
    state = gateway(request)
    owner = owner_of(state, request)
    after, limit, order = _page_params(request)
    page = await state.store.list_input_items(response_id, owner, after=after, limit=limit, order=order)
    if page is None:
        raise NotFound(f"Response with id {response_id!r} not found", param="response_id")
    return json_response(_list_body(page))


# -- conversations -----------------------------------------------------------------------------------
def _conversation_body(conv: StoredConversation) -> dict[str, Any]:
    return {"id": conv.id, "object": "conversation", "created_at": conv.created_at, "metadata": conv.metadata}


@router.post("/v1/conversations")
async def create_conversation(request: Request) -> Response:
    state = gateway(request)
    owner = owner_of(state, request)
    req = ConversationCreate.model_validate(await json_body(request))
    items = normalize_items(req.items or [], param="items")
    conv = StoredConversation(
        id=new_id("conv"), owner=owner, created_at=int(time.time()), metadata=req.metadata or {}
    )
    await state.store.create_conversation(conv, items, limits=state.settings.conversation_limits)
    return json_response(_conversation_body(conv))


async def _conversation(state: Any, conversation_id: str, owner: str) -> StoredConversation:
    conv = await state.store.get_conversation(conversation_id, owner)
    if conv is None:
        raise NotFound(f"Conversation with id {conversation_id!r} not found", param="conversation_id")
    return conv  # type: ignore[no-any-return]


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, request: Request) -> Response:
    state = gateway(request)
    return json_response(
        _conversation_body(await _conversation(state, conversation_id, owner_of(state, request)))
    )


@router.post("/v1/conversations/{conversation_id}")
async def update_conversation(conversation_id: str, request: Request) -> Response:
    state = gateway(request)
    owner = owner_of(state, request)
    req = ConversationUpdate.model_validate(await json_body(request))
    # `null` clears the metadata, as `{}` does.
    conv = await state.store.update_conversation_metadata(conversation_id, owner, req.metadata or {})
    if conv is None:
        raise NotFound(f"Conversation with id {conversation_id!r} not found", param="conversation_id")
    return json_response(_conversation_body(conv))


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    state = gateway(request)
    if not await state.store.delete_conversation(conversation_id, owner_of(state, request)):
        raise NotFound(f"Conversation with id {conversation_id!r} not found", param="conversation_id")
    return json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


@router.get("/v1/conversations/{conversation_id}/items")
async def list_items(conversation_id: str, request: Request) -> Response:
    state = gateway(request)
    owner = owner_of(state, request)
    after, limit, order = _page_params(request)
    page = await state.store.list_conversation_items(
        conversation_id, owner, after=after, limit=limit, order=order
    )
    if page is None:
        raise NotFound(f"Conversation with id {conversation_id!r} not found", param="conversation_id")
    return json_response(_list_body(page))


@router.post("/v1/conversations/{conversation_id}/items")
async def add_items(conversation_id: str, request: Request) -> Response:
    state = gateway(request)
    owner = owner_of(state, request)
    req = ConversationItemsCreate.model_validate(await json_body(request))
    items = normalize_items(req.items, param="items")
    added = await state.store.add_conversation_items(
        conversation_id, owner, items, limits=state.settings.conversation_limits
    )
    if added is None:
        raise NotFound(f"Conversation with id {conversation_id!r} not found", param="conversation_id")
    data = [entry.item for entry in added]
    return json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"],
            "last_id": data[-1]["id"],
            "has_more": False,
        }
    )


@router.get("/v1/conversations/{conversation_id}/items/{item_id}")
async def get_item(conversation_id: str, item_id: str, request: Request) -> Response:
    state = gateway(request)
    owner = owner_of(state, request)
    await _conversation(state, conversation_id, owner)
    entry = await state.store.get_conversation_item(conversation_id, item_id, owner)
    if entry is None:
        raise NotFound(f"Item with id {item_id!r} not found", param="item_id")
    return json_response(entry.item)


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}")
async def delete_item(conversation_id: str, item_id: str, request: Request) -> Response:
    state = gateway(request)
    owner = owner_of(state, request)
    conv = await _conversation(state, conversation_id, owner)
    if not await state.store.delete_conversation_item(conversation_id, item_id, owner):
        raise NotFound(f"Item with id {item_id!r} not found", param="item_id")
    return json_response(_conversation_body(conv))
