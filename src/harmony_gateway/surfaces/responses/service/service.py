"""The Responses service: prepares a response and plans its run through the shared driver (stream or
JSON body), or starts it in the background; `cancel_response` stops a background one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ....errors import InvalidRequest
from ....pipeline.context import GatewayState, PreparedRequest, RequestContext
from ....pipeline.drive import Generation, Planned, open_generation
from ..framer import ResponsesFramer, finish_response, persist
from ..output import ResponseBuilder
from ..plan import ResponsePlan, prepare_responses, render_turn
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
    return generation_of(state, plan, new_builder(plan, stream=req.stream), ctx)


def new_builder(plan: ResponsePlan, *, stream: bool) -> ResponseBuilder:
    """The builder of a response that runs now (a stream, a JSON body or a WebSocket turn)."""
    builder = ResponseBuilder(plan.envelope, stream=stream)
    builder.seal_reasoning = plan.seal_reasoning  # hook: encrypted reasoning items
    return builder


def generation_of(
    state: GatewayState, plan: ResponsePlan, builder: ResponseBuilder, ctx: RequestContext
) -> Generation[Any]:
    """The response's run through the driver: its turns framed by `ResponsesFramer` into `builder`'s
    frames (a stream: SSE or a WebSocket's lines, `builder.encode`) or into its JSON body."""
    ctx.parsers = plan.parsers  # filled per iteration, read once by finish_request
    framer = ResponsesFramer(state, plan, builder, ctx)
    stream = builder.stream

    async def open_turns() -> AsyncIterator[Any]:
        if stream:
            builder.start()
        # tool listings, approved calls, then the Harmony prompt
        await begin(state, plan, builder, ctx)
        ctx.prompt_tokens = len(plan.prepared.input_ids)
        # Wait for the first chunk so early failures are HTTP errors. A non-stream response without
        # gateway tools takes the engine's output in one message: one gRPC message instead of one per
        # token, the same tokens.
        engine_stream = stream or plan.tools is not None
        first = await open_generation(state, plan.prepared, ctx, stream=engine_stream)
        return turns(state, plan, ctx, builder, first)

    async def body() -> dict[str, Any]:
        out = finish_response(state, plan, builder, ctx)
        await persist(state, plan, out)
        return out

    if stream:
        return Generation(open_turns, framer, head=builder.take, close=plan.close_tools)
    return Generation(open_turns, framer, body=body, close=plan.close_tools)


def refuse_request_mcp_servers(request: dict[str, Any]) -> None:
    """Raises InvalidRequest naming the first MCP tool that gives a `server_url`: the inspector does not
    connect to servers a request names."""
    tools = request.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if isinstance(tool, dict) and tool.get("type") == "mcp" and tool.get("server_url") is not None:
            raise InvalidRequest(
                "the inspector does not connect to MCP servers named in a request; render without this "
                "tool, or with a server configured on the gateway (server_label alone)",
                param=f"request.tools[{index}].server_url",
            )


async def inspect_responses(
    state: GatewayState, body: dict[str, Any], ctx: RequestContext, notes: list[str]
) -> PreparedRequest:
    """prepare_responses loads the chain or conversation as the key's owner (another key's response is
    a 404) and lists MCP tools; the connections it opens are closed before returning."""
    refuse_request_mcp_servers(body)
    plan = await prepare_responses(state, ResponsesRequest.model_validate(body), ctx)
    try:
        if plan.chain_root == plan.response_id:
            notes.append(
                "a new stored response is routed by its own id, chosen when it is created: a policy that "
                "uses the routing key (consistent_hash) may pick another worker than shown"
            )
        if plan.approvals:
            # The real path runs approved MCP calls before rendering; the inspector runs no tools.
            notes.append("approved MCP calls are not run by the inspector: their results render empty")
            await render_turn(state, plan)
        return plan.prepared
    finally:
        await plan.close_tools()


__all__ = ["generation_of", "inspect_responses", "new_builder", "plan_responses"]
