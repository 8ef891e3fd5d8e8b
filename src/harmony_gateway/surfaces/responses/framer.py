"""How a response's output is framed and stored, for every way it runs (stream, JSON, background).

A response's turns (`turns.py`) are read by the shared stream driver (pipeline/drive.py) with
`ResponsesFramer`, which parses each generation into the response builder and frames its events: SSE
frames for a stream, nothing for a JSON body (built from the builder afterwards), and published events
for a background response (`background.py`). A stored response is written before the client hears it is
complete; a stream that fails after `response.created` ends with `response.failed`, also stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ...engines.base import EngineChunk
from ...errors import GatewayError, InvalidRequest, NotFound
from ...pipeline.context import GatewayState, RequestContext
from ...pipeline.drive import RequestFramer
from ...pipeline.reasoning_budget import budget_exceeded
from ...storage.base import StoredResponse
from ...types.limits import CONVERSATION_TOO_LARGE
from .objects import redacted_tools
from .output import ResponseBuilder, ToolSlot
from .plan import (
    DATE_KEY,
    ROOT_KEY,
    ResponsePlan,
    parse_into,
    token_texts,
)

log = logging.getLogger(__name__)

#: Private `StoredResponse.metadata` key of a background response: the process running it
#: (`service.runner.default_runner_id`), so a restarted process finds the work it left behind.
RUNNER_KEY = "_runner"
#: Statuses a background response may still leave (a cancel or its own ending moves it on).
ACTIVE_STATUSES = frozenset({"queued", "in_progress"})

#: Recorded events of a background response, published as they form (`events.EventFeed.publish`).
Publish = Callable[[list[tuple[dict[str, Any], bytes]]], Awaitable[None]]


class ResponsesFramer(RequestFramer):
    """The Responses surface's side of the stream driver (`pipeline.drive.Framer`).

    Each engine chunk is parsed into the builder and each tool call that ran is reported; the builder's
    new events go out at once (a stream), stay in the builder (a JSON body) or are published (`publish`,
    a background response). A stream's tail is the terminal event, sent after the response is stored; a
    failure is `response.failed`, stored too when `store` is set. The request's `next_sequence` follows
    the events handed out (the stream's head is taken right after the framer is made), so a stream cut
    from outside ends with an `error` event numbered after them."""

    __slots__ = ("_builder", "_failed", "_plan", "_publish", "_state", "_to_store", "unsettled")

    def __init__(
        self,
        state: GatewayState,
        plan: ResponsePlan,
        builder: ResponseBuilder,
        ctx: RequestContext,
        *,
        publish: Publish | None = None,
    ) -> None:
        super().__init__(ctx)
        self._state = state
        self._plan = plan
        self._builder = builder
        if plan.prepared.return_logprob and builder.token_text is None:
            builder.token_text = token_texts(state.encoding)
        ctx.next_sequence = builder.sequence
        self._publish = publish
        self._to_store: dict[str, Any] | None = None  # the final Response, stored before it is told
        self._failed = False
        self.unsettled = False

    def _take(self) -> bytes:
        """The builder's new frames, handed to the driver; the request's numbering follows them."""
        framed = self._builder.take()
        self._ctx.next_sequence = self._builder.sequence
        return framed

    def feed(self, item: EngineChunk | ToolSlot) -> bytes:
        builder = self._builder
        if isinstance(item, ToolSlot):
            builder.complete_tool(item, item.outcome.output, item.outcome.error)
        else:
            plan = self._plan
            plan.account(item)
            assert plan.turn is not None
            parse_into(builder, plan.turn.parser, item)
        if not builder.ready():
            return b""
        if self._publish is not None:
            self.unsettled = True
            return b""
        return self._take()

    def stopped(self) -> bool:
        return False  # a response reads its turns to the end

    def tail(self) -> bytes:
        self._to_store = finish_response(self._state, self._plan, self._builder, self._ctx)
        self.unsettled = True
        return self._take()

    def error(self, exc: BaseException) -> bytes:
        """Close the open items (incomplete) and end with `response.failed`. The conversation is not
        extended by a failed turn. (A JSON body's failure is its HTTP error instead, storing nothing: its
        client never learnt the response id.)"""
        builder = self._builder
        builder.take()
        message = exc.message if isinstance(exc, GatewayError) else "internal error while generating"
        builder.usage = self._plan.usage()
        body = builder.finish("failed", error={"code": "server_error", "message": message})
        if self._plan.request.store:
            self._to_store, self._failed = body, True  # OpenAI keeps failed responses; GET returns it
            self.unsettled = True
        return self._take()

    def completion_tokens(self) -> int:
        return self._plan.output_tokens_so_far()

    async def settle(self) -> None:
        self.unsettled = False
        if self._publish is not None and self._builder.ready():
            await self._publish(self._builder.take_events())
        body, self._to_store = self._to_store, None
        if body is None:
            return
        if not self._failed:
            await persist(self._state, self._plan, body)
            return
        try:
            await self._state.store.put_response(record_of(self._plan, body))
        except Exception as exc:
            log.warning("failed response %s could not be stored: %s", self._plan.response_id, exc)


def finish_response(
    state: GatewayState, plan: ResponsePlan, builder: ResponseBuilder, ctx: RequestContext
) -> dict[str, Any]:
    """The final Response (usage, status, terminal event) once every turn has ended."""
    builder.usage = plan.usage()
    if plan.prepared.max_reasoning_tokens is not None:
        # As chat's completion_tokens_details.reasoning_budget_exceeded (pipeline/reasoning_budget.py).
        builder.usage["output_tokens_details"]["reasoning_budget_exceeded"] = budget_exceeded(ctx)
    if plan.uses_tools:
        state.metrics.mcp_iterations.labels(plan.prepared.group.name).observe(plan.iterations)
    if plan.finish_reason == "length":
        return builder.finish("incomplete", incomplete_reason="max_output_tokens")
    return builder.finish("completed")


def record_of(plan: ResponsePlan, body: dict[str, Any], *, background: bool = False) -> StoredResponse:
    metadata: dict[str, Any] = {ROOT_KEY: plan.chain_root} if plan.chain_root else {}
    prefix = plan.prepared.prefix
    if prefix is not None and prefix.options.conversation_start_date:
        metadata[DATE_KEY] = prefix.options.conversation_start_date
    return StoredResponse(
        id=plan.response_id,
        owner=plan.owner,
        created_at=body["created_at"],
        updated_at=time.time(),
        status=body["status"],
        model=body["model"],
        response=body,
        input_items=plan.listed_inputs(),
        history=[m.to_dict() for m in (*plan.turn_messages, *plan.generated)],
        previous_response_id=plan.request.previous_response_id,
        conversation_id=plan.conversation_id,
        background=background,
        request=dict(plan.request.model_dump(exclude_none=True), tools=redacted_tools(plan.request.tools)),
        metadata=metadata,
    )


async def persist(
    state: GatewayState, plan: ResponsePlan, body: dict[str, Any], *, background: bool = False
) -> bool:
    """Store the response (before it is reported complete) and extend its conversation. A background
    response is stored only while it is still queued or in progress: False (nothing written, the
    conversation not extended) when a cancel was stored first."""
    if plan.request.store:
        record = record_of(plan, body, background=background)
        if background:
            record.metadata[RUNNER_KEY] = state.background.runner_id
            if not await state.store.update_response_if(record, ACTIVE_STATUSES):
                return False
        else:
            await state.store.put_response(record)
    if plan.conversation_id:
        # An item_reference points at an item that is already stored (in this conversation or a
        # response): the conversation gets the new items only, never a second copy of that id.
        new_inputs = [item for item in plan.input_items if item.get("type") != "item_reference"]
        try:
            added = await state.store.add_conversation_items(
                plan.conversation_id,
                plan.owner,
                [*new_inputs, *body["output"]],
                limits=state.settings.conversation_limits,
            )
        except InvalidRequest as exc:
            if exc.code != CONVERSATION_TOO_LARGE:
                raise
            # The request passed the limits when it was prepared; its output (or a racing writer) did
            # not fit. The response is stored, the conversation is not extended: say so on `conversation`.
            raise InvalidRequest(
                f"the response is stored but its items do not fit the conversation: {exc.message}",
                param="conversation",
                code=exc.code,
            ) from exc
        if added is None:
            raise NotFound(f"Conversation with id {plan.conversation_id!r} not found", param="conversation")
    return True


__all__ = ["Publish", "ResponsesFramer", "finish_response", "persist", "record_of"]
