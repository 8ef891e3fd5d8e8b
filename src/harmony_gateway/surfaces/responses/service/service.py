"""The Responses service: prepares a response and plans its run through the shared driver (stream or
JSON body), or starts it in the background; `cancel_response` stops a background one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ....pipeline.context import GatewayState, RequestContext
from ....pipeline.drive import Generation, Planned, open_generation
from ..framer import ResponsesFramer, finish_response, persist
from ..output import ResponseBuilder
from ..plan import prepare_responses
from ..types import ResponsesRequest
from .background import start_background
from .turns import begin, turns


async def plan_responses(state: GatewayState, req: ResponsesRequest, ctx: RequestContext) -> Planned:
    """A response prepared (items, chain or conversation, tools connected and listed) with its turns and
    framer; a background response is queued and its body answered at once."""
    plan = await prepare_responses(state, req, ctx)
    if req.background:
        try:
            return await start_background(state, plan, ctx)
        except BaseException:
            await plan.close_tools()
            raise
    ctx.parsers = plan.parsers  # filled per iteration, read once by finish_request
    builder = ResponseBuilder(plan.envelope, stream=req.stream)
    builder.seal_reasoning = plan.seal_reasoning  # hook: encrypted reasoning items
    framer = ResponsesFramer(state, plan, builder, ctx)

    async def open_turns() -> AsyncIterator[Any]:
        if req.stream:
            builder.start()
        # tool listings, approved calls, then the Harmony prompt
        await begin(state, plan, builder)
        ctx.prompt_tokens = len(plan.prepared.input_ids)
        # Wait for the first chunk so early failures are HTTP errors. A non-stream response without
        # gateway tools takes the engine's output in one message: one gRPC message instead of one per
        # token, the same tokens.
        engine_stream = req.stream or plan.tools is not None
        first = await open_generation(state, plan.prepared, ctx, stream=engine_stream)
        return turns(state, plan, ctx, builder, first)

    async def body() -> dict[str, Any]:
        out = finish_response(state, plan, builder, ctx)
        await persist(state, plan, out)
        return out

    if req.stream:
        return Generation(open_turns, framer, head=builder.take, close=plan.close_tools)
    return Generation(open_turns, framer, body=body, close=plan.close_tools)


__all__ = ["plan_responses"]
