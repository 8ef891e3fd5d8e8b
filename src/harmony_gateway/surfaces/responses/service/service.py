"""The Responses service: prepares a response, runs its turns through the shared stream driver (stream,
JSON body or background task) and stores it; `cancel_response` stops a background one."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from ....pipeline.context import GatewayState, RequestContext
from ....pipeline.drive import collect, drive, open_generation
from ..framer import ResponsesFramer, finish_response, persist
from ..output import ResponseBuilder
from ..plan import prepare_responses
from ..types import ResponsesRequest
from .background import start_background
from .turns import begin, turns


async def run_responses(
    state: GatewayState, req: ResponsesRequest, ctx: RequestContext
) -> dict[str, Any] | AsyncGenerator[bytes, None]:
    # 1) prepare: items, chain or conversation, tools connected and listed
    plan = await prepare_responses(state, req, ctx)
    if not req.background:
        ctx.parsers = plan.parsers  # filled per iteration, read once by finish_request
    try:
        if req.background:
            return await start_background(state, plan, ctx)
        builder = ResponseBuilder(plan.envelope, stream=req.stream)
        builder.seal_reasoning = plan.seal_reasoning  # hook: encrypted reasoning items
        if req.stream:
            builder.start()
        # tool listings, approved calls, then the Harmony prompt
        await begin(state, plan, builder)
        ctx.prompt_tokens = len(plan.prepared.input_ids)
        # 2) select, 3) build, 4) dispatch: wait for the first chunk so early failures are HTTP errors.
        # A non-stream response without gateway tools takes the engine's output in one message: one
        # gRPC message instead of one per token, the same tokens.
        engine_stream = req.stream or plan.tools is not None
        first = await open_generation(state, plan.prepared, ctx, stream=engine_stream)
    except BaseException:
        await plan.close_tools()
        raise
    framer = ResponsesFramer(state, plan, builder, ctx)
    source = turns(state, plan, ctx, builder, first)
    if not req.stream:
        # 5) parse (and run tools), 6) respond
        await collect(ctx, source, framer)
        body = finish_response(state, plan, builder, ctx)
        await persist(state, plan, body)
        return body
    ctx.cleanups.append(plan.close_tools)  # also when the stream never starts (client gone early)
    return drive(ctx, source, framer, head=builder.take())


__all__ = ["run_responses"]
