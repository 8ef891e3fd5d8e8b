"""Compacting conversations: `POST /v1/responses/compact`, and a response's own compaction when its
prompt passes `context_management`'s threshold (`compact_if_due`).

Both ask the served model for a summary (`compaction.summary_request`, `compaction.summarize`) through
the shared driver and seal it for the tenant. `POST /v1/responses/compact` reads the conversation as a
response request would (its input items or `previous_response_id` chain, prepared by
`plan.prepare_responses`) and answers OpenAI's compacted response object: every user message, then one
`compaction` item. A response that compacts itself reports the compaction item as an output item (with
its added and done events when streaming), before what it generates from the compacted conversation.
"""

from __future__ import annotations

import time
from typing import Any

from ....errors import InvalidRequest
from ....pipeline.context import GatewayState, RequestContext
from ....pipeline.drive import Generation, open_generation
from ....pipeline.reasoning_store import reasoning_vault
from ..compaction import (
    SummaryFramer,
    compactable,
    compacted,
    compaction_item,
    summarize,
    summary_message,
    summary_request,
    user_items,
)
from ..mapper import new_id
from ..objects import usage_of
from ..output import ResponseBuilder
from ..plan import ResponsePlan, prepare_responses, render_turn
from ..types import CompactRequest, ResponsesRequest


def requested_model(state: GatewayState, model: str | None) -> str:
    """The model a request names; when it names none (the token-count and compaction bodies allow
    that), the one Harmony model the gateway serves. Raises InvalidRequest naming `model` otherwise."""
    if model is not None:
        return model
    served = [name for name, group in state.fleet.groups.items() if group.harmony]
    if len(served) != 1:
        raise InvalidRequest("model is required: name the model to use", param="model")
    return served[0]


async def plan_compact(state: GatewayState, req: CompactRequest, ctx: RequestContext) -> Generation[Any]:
    """`POST /v1/responses/compact`: the summary generation of the conversation the request names, and
    the compacted response object built from it."""
    if (req.model_extra or {}).get("conversation") is not None:
        raise InvalidRequest(
            "compact takes input items or previous_response_id; pass a conversation's items as input",
            param="conversation",
        )
    if req.previous_response_id is None and not req.input:
        raise InvalidRequest("nothing to compact: give input or previous_response_id", param="input")
    conversation = ResponsesRequest(
        model=requested_model(state, req.model),
        input=req.input or [],
        previous_response_id=req.previous_response_id,
        instructions=req.instructions,
        prompt_cache_key=req.prompt_cache_key,
        store=False,
        # A conversation longer than the context is summarised from its newest part (`summary_request`).
        truncation="auto",
    )
    plan = await prepare_responses(state, conversation, ctx, render=False)
    await plan.close_tools()  # a compaction runs no tools
    messages = plan.history + plan.turn_messages
    prepared = await summary_request(state, plan.prepared, messages, param="input")
    ctx.prompt_tokens = len(prepared.input_ids)
    framer = SummaryFramer(state, prepared, ctx)
    vault = await reasoning_vault(state, ctx.owner)

    async def open_summary() -> Any:
        return await open_generation(state, prepared, ctx, stream=False)

    async def body() -> dict[str, Any]:
        summary = framer.summary()
        sealed = vault.seal_summary(summary.text)
        return {
            "id": new_id("resp"),
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": [*user_items(compacted(messages)), compaction_item(sealed)],
            "usage": usage_of(
                summary.prompt_tokens,
                summary.completion_tokens,
                summary.reasoning_tokens,
                summary.cached_tokens,
            ),
        }

    return Generation(open_summary, framer, body=body)


async def compact_if_due(
    state: GatewayState, plan: ResponsePlan, ctx: RequestContext, builder: ResponseBuilder
) -> None:
    """Before a generation of a response with `context_management` compaction: when its rendered prompt
    passes the threshold and holds something a summary would stand for, summarise the conversation,
    report the compaction item, and render the prompt again from the summary on. The summary's tokens
    count in the response's usage."""
    threshold = plan.compact_threshold
    if threshold is None or len(plan.prepared.input_ids) <= threshold:
        return
    messages = compacted(plan.history + plan.turn_messages + plan.generated)
    if not compactable(messages):
        return
    prepared = await summary_request(state, plan.prepared, messages, param="input")
    summary = await summarize(state, prepared, ctx)
    vault = await reasoning_vault(state, plan.owner)
    builder.add_item(compaction_item(vault.seal_summary(summary.text)))
    plan.generated.append(summary_message(summary.text))
    plan.input_tokens += summary.prompt_tokens
    plan.output_tokens += summary.completion_tokens
    plan.reasoning_tokens += summary.reasoning_tokens
    plan.cached_tokens += summary.cached_tokens
    await render_turn(state, plan)


__all__ = ["compact_if_due", "plan_compact", "requested_model"]
