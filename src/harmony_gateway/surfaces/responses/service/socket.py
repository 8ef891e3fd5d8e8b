"""A Responses turn on a WebSocket (`response.create`), and the socket's cache of its newest chain.

A turn is the streamed run of a response, planned as for `POST /v1/responses` with `stream: true`; only
its events are encoded for the socket (one JSON event per line, `output.json_line`; the socket sends
each line as one message) instead of as SSE frames. `background` is refused, as OpenAI refuses it on a
WebSocket. `generate: false` (OpenAI's warm-up) prepares the response and completes it with no output.

`SocketCache` is the socket's in-memory state (OpenAI's "connection-local cache"): the
`previous_response_id` chain of the newest response the socket completed, kept whether or not it was
stored, so a chain continues on the same socket with `store: false`. A turn reads its chain there first
and from the store otherwise (a stored response from elsewhere, or one older than the cached chain); a
response that is neither is `previous_response_not_found`. The socket belongs to one principal, so the
cache holds that tenant's responses only. It keeps no more history than a turn could read from the store
(the same byte budget, newest first), and a failed turn leaves it as it was.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ....errors import InvalidRequest
from ....pipeline.context import GatewayState, RequestContext
from ....pipeline.drive import Generation
from ....storage.base import (
    RecentChain,
    Store,
    StoredResponse,
    check_budget,
    check_max_depth,
    replay_size,
    within_budget,
)
from ..framer import ResponsesFramer, record_of
from ..output import ResponseBuilder, json_line
from ..plan import ResponsePlan, prepare_responses
from ..types import ResponsesRequest
from .service import generation_of, new_builder

#: Statuses of a response a later turn may continue from (a failed one is not kept).
CONTINUABLE = frozenset({"completed", "incomplete"})

#: OpenAI's `stream_id`: the lane a `response.create` names, echoed on every event of its response.
_STREAM_ID = re.compile(r"[A-Za-z0-9_.-]{1,256}")


class SocketCache:
    """The chain of the newest response a socket completed, oldest first, within the byte budget of the
    last chain a turn read; a `ChainReader` (plan.py) in front of `store`."""

    __slots__ = ("_budget", "_chain", "_loaded", "_omitted", "_sizes", "source", "store")

    def __init__(self, store: Store) -> None:
        self.store = store
        self._chain: list[StoredResponse] = []
        self._sizes: list[int] = []  # `replay_size` of each, oldest first
        self._omitted = False  # older responses of the chain exist that the cache does not hold
        self._budget: int | None = None
        #: The chain the turn under way continues (None: it starts one), with each response's size.
        self._loaded: tuple[list[StoredResponse], list[int], bool] | None = None
        #: Where the turn under way read its chain: "cache", "store", or None (it continues nothing).
        self.source: str | None = None

    def __len__(self) -> int:
        return len(self._chain)

    def ids(self) -> list[str]:
        return [record.id for record in self._chain]

    async def load_recent_chain(
        self, response_id: str, owner: str, *, max_bytes: int | None, max_depth: int = 100
    ) -> RecentChain:
        """`Store.load_recent_chain`, answered from the cache when `response_id` is one of its
        responses (the newest or an ancestor: a fork), else from the store. Raises InvalidRequest
        `previous_response_not_found` when neither has it."""
        check_budget(max_bytes)
        check_max_depth(max_depth)
        self._budget = max_bytes
        at = next((n for n, r in enumerate(self._chain) if r.id == response_id and r.owner == owner), None)
        if at is None:
            found = await self.store.load_recent_chain(
                response_id, owner, max_bytes=max_bytes, max_depth=max_depth
            )
            self._loaded = (found.responses, [replay_size(r) for r in found.responses], found.omitted)
            self.source = "store"
            return found
        chain, sizes = self._chain[: at + 1], self._sizes[: at + 1]
        kept = within_budget(sizes[::-1], max_bytes)
        kept = min(kept, max_depth)
        chain, sizes = chain[len(chain) - kept :], sizes[len(sizes) - kept :]
        omitted = self._omitted or kept < at + 1
        self._loaded = (chain, sizes, omitted)
        self.source = "cache"
        return RecentChain(list(chain), omitted=omitted)

    def begin_turn(self) -> None:
        """A new turn: it continues nothing until it loads a chain."""
        self._loaded = None
        self.source = None

    def remember(self, record: StoredResponse) -> None:
        """The turn's response completed: it and the chain it continued become the cached chain."""
        chain, sizes, omitted = self._loaded or ([], [], False)
        chain, sizes = [*chain, record], [*sizes, replay_size(record)]
        kept = within_budget(sizes[::-1], self._budget)
        self._chain, self._sizes = chain[len(chain) - kept :], sizes[len(sizes) - kept :]
        self._omitted = omitted or kept < len(chain)
        self._loaded = None


@dataclass(eq=False)
class SocketTurn:
    """One `response.create` planned: its generation (answered by `pipeline.drive.answer`) and what the
    socket needs around it."""

    generation: Generation[Any]
    plan: ResponsePlan
    builder: ResponseBuilder
    cache: SocketCache

    def ended(self) -> bool:
        """True once the response's terminal event is framed: the piece the driver yields now is the
        turn's last."""
        return self.builder.final is not None

    def remember(self) -> None:
        """Keep the response in the socket's cache when a later turn may continue it."""
        final = self.builder.final
        if final is not None and final["status"] in CONTINUABLE:
            self.cache.remember(record_of(self.plan, final))


def socket_body(event: dict[str, Any]) -> dict[str, Any]:
    """The `POST /v1/responses` body of a `response.create` event: its fields less the event's own
    (`type`, `stream_id`); `stream` is what a socket always does, whatever the event says."""
    body = {key: value for key, value in event.items() if key not in ("type", "stream_id")}
    body["stream"] = True
    return body


def stream_id_of(event: dict[str, Any]) -> str | None:
    """The event's `stream_id`, checked as OpenAI's schema has it; InvalidRequest naming it otherwise."""
    value = event.get("stream_id")
    if value is None:
        return None
    if not isinstance(value, str) or not _STREAM_ID.fullmatch(value):
        raise InvalidRequest("stream_id must be 1 to 256 letters, digits, '_', '.' or '-'", param="stream_id")
    return value


def event_encoder(stream_id: str | None) -> Callable[[dict[str, Any]], bytes]:
    """How the turn's events are encoded: a line of JSON each, carrying `stream_id` when the turn named
    one."""
    if stream_id is None:
        return json_line

    def encode(event: dict[str, Any]) -> bytes:
        event["stream_id"] = stream_id
        return json_line(event)

    return encode


async def plan_socket_turn(
    state: GatewayState,
    req: ResponsesRequest,
    ctx: RequestContext,
    cache: SocketCache,
    *,
    stream_id: str | None = None,
) -> SocketTurn:
    """Prepare the turn's response (its chain read through `cache`) and plan its streamed run. Raises
    InvalidRequest for `background`, and what `prepare_responses` raises."""
    if req.background:
        raise InvalidRequest(
            "background responses are not supported over a WebSocket; use POST /v1/responses",
            param="background",
        )
    generate = (req.model_extra or {}).get("generate", True)
    if not isinstance(generate, bool):
        raise InvalidRequest("generate must be a boolean", param="generate")
    cache.begin_turn()
    plan = await prepare_responses(state, req, ctx, chains=cache)
    builder = new_builder(plan, stream=True)
    builder.encode = event_encoder(stream_id)
    generation = generation_of(state, plan, builder, ctx) if generate else warm_up(state, plan, builder, ctx)
    return SocketTurn(generation, plan, builder, cache)


def warm_up(
    state: GatewayState, plan: ResponsePlan, builder: ResponseBuilder, ctx: RequestContext
) -> Generation[Any]:
    """A `generate: false` turn (OpenAI's warm-up): the response is prepared as any other (its input
    validated and rendered, its chain read, stored when `store` is set) and completes at once with no
    output and no engine request; a later turn continues from it and sends only what is new."""

    async def open_nothing() -> AsyncIterator[Any]:
        builder.start()
        return _nothing()

    framer = ResponsesFramer(state, plan, builder, ctx)
    return Generation(open_nothing, framer, head=builder.take, close=plan.close_tools)


async def _nothing() -> AsyncIterator[Any]:
    return
    yield  # an async generator with nothing to give


__all__ = [
    "CONTINUABLE",
    "SocketCache",
    "SocketTurn",
    "event_encoder",
    "plan_socket_turn",
    "socket_body",
    "stream_id_of",
    "warm_up",
]
