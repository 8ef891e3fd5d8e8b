"""The turns of one response: the model's generations and, between them, the gateway-executed tool calls.

Gateway-executed tools (MCP servers, the `browser` / `python` built-ins; REFERENCE §5) turn one
generation into a loop: tools are listed before generation (`mcp_list_tools` items, once per chain),
each call the model makes is run (`mcp_call` / `web_search_call` / `code_interpreter_call` items), the
call and its result are appended to the conversation, and the model generates again on the same worker
with the remaining output budget, until a final answer, a function call, an approval request, length,
or the `max_tool_calls` limit. All iterations stream into one response with one terminal event.

`turns` is the source the stream driver (pipeline/drive.py) reads for a response: each generation's
engine chunks and, after a generation, each call it made once it has run (its `ToolSlot`, outcome set).
Closing it (the client left, a failure) aborts the generation under way and closes the request's own
MCP connections.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio

from ....engines.base import EngineChunk
from ....errors import InvalidRequest
from ....harmony import token_parser as tp
from ....harmony.messages import Msg, tool_result
from ....mcp.approval import declined_text
from ....mcp.tool_loop import APPROVAL, OVER_LIMIT, ToolLoop
from ....pipeline.context import GatewayState, RequestContext
from ....pipeline.drive import open_generation
from ..output import ResponseBuilder, ToolSlot
from ..plan import ResponsePlan, remaining_budget, render_turn
from .compact import compact_if_due

#: Seconds a cancelled request may spend closing its own MCP connections or writing its final state.
CLOSE_TIMEOUT = 5.0


async def begin(
    state: GatewayState, plan: ResponsePlan, builder: ResponseBuilder, ctx: RequestContext
) -> None:
    """Before the first generation: report the tool listings, run the calls this input approves (or tell
    the model they were declined), render the prompt, and compact the conversation when it passes the
    request's `context_management` threshold. Approved calls count against `max_tool_calls`: past the
    limit they do not run and the model reads the limit's message, as for its own calls."""
    loop = plan.tools
    if loop is not None:
        for item in loop.list_items():
            builder.add_list_tools(item)
    if plan.approvals:
        await _run_approved(state, plan, builder, loop)
    await compact_if_due(state, plan, ctx, builder)


async def _run_approved(
    state: GatewayState, plan: ResponsePlan, builder: ResponseBuilder, loop: ToolLoop | None
) -> None:
    """Run (or decline) the calls this input answers, fill in their results, and render the prompt."""
    for decision, placeholder in plan.approvals:
        request = decision.request
        recipient = f"{request.get('server_label')}.{request.get('name')}"
        arguments = str(request.get("arguments") or "")
        if not decision.approve or loop is None:
            text = declined_text(decision.reason)
        elif not loop.take_call():
            text = loop.limit_text()
        else:
            call = loop.resolve(recipient)
            slot = builder.open_approved_call(
                str(request.get("server_label")), str(request.get("name")), arguments, decision.request_id
            )
            outcome = await loop.execute(call, arguments)
            builder.complete_tool(slot, outcome.output, outcome.error)
            text = outcome.model_text
        filled = placeholder._replace(text=text)
        plan.turn_messages = [filled if m is placeholder else m for m in plan.turn_messages]
    await render_turn(state, plan)


async def turns(
    state: GatewayState,
    plan: ResponsePlan,
    ctx: RequestContext,
    builder: ResponseBuilder,
    first: AsyncIterator[EngineChunk] | None = None,
) -> AsyncIterator[EngineChunk | ToolSlot]:
    """The response's generations (the first one already open when `first` is given) and the tool calls
    between them. Later generations stay on the worker of the previous one while it is available (its
    prefix cache holds the conversation). The reader completes each yielded `ToolSlot` in the builder
    before asking for more: the next call waits until the one before it is reported."""
    loop = plan.tools
    builder.tools = loop  # it decides how each tool call the model makes is reported
    pinned = None
    try:
        while True:
            plan.start_turn(state.encoding)
            chunks = (
                first
                if first is not None
                else await open_generation(state, plan.prepared, ctx, stream=True, pinned=pinned)
            )
            first = None
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for chunk in chunks:
                    yield chunk
            pinned = ctx.worker
            parser = plan.end_turn(builder).parser
            if loop is None:
                return
            # Run this turn's calls in order; the builder holds later output until each call is reported.
            while (slot := builder.awaiting) is not None:
                assert slot.decision is not None
                slot.outcome = await loop.execute(slot.decision, slot.msg.text)
                yield slot
                if builder.awaiting is slot:
                    raise RuntimeError("a tool call was yielded and not completed by the reader")
            if not await _next_turn(state, plan, builder, loop, parser):
                return
            await compact_if_due(state, plan, ctx, builder)
    finally:
        # A client that left cancels this generator, mid tool call too; the request's MCP connections
        # still close (shielded: the cancelled scope would cancel the close too).
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
            await plan.close_tools()


async def _next_turn(
    state: GatewayState,
    plan: ResponsePlan,
    builder: ResponseBuilder,
    loop: ToolLoop,
    parser: tp.HarmonyOutputParser,
) -> bool:
    """After a generation whose gateway calls have run: append the calls' results to the conversation and
    render the next prompt. False when the response stops here (no calls, a function call, an approval
    request, length, or the model calling tools again after it was told the limit was reached)."""
    slots, builder.tool_slots = builder.tool_slots, []
    if plan.finish_reason == "length" or not slots:
        return False
    results: list[Msg] = []
    approval = over_limit = False
    for slot in slots:
        if slot.cut or slot.decision is None:
            continue
        channel = slot.msg.channel or "commentary"
        if slot.decision.kind == APPROVAL:
            approval = True
        elif slot.decision.kind == OVER_LIMIT:
            over_limit = True
            results.append(tool_result(slot.decision.recipient, loop.limit_text(), channel=channel))
        elif slot.outcome is not None:
            results.append(tool_result(slot.decision.recipient, slot.outcome.model_text, channel=channel))
    plan.generated.extend(results)
    if approval or not results or any(m.kind == tp.FUNCTION_CALL for m in parser.messages):
        return False
    if over_limit:
        plan.limit_turns += 1
        if plan.limit_turns > 1:
            # The tool-call budget is spent: a length stop, as a budget cut short (the published
            # schemas name no incomplete reason of its own for it).
            plan.finish_reason = "length"
            return False
    remaining = remaining_budget(plan)
    if remaining is not None and remaining <= 0:
        plan.finish_reason = "length"
        return False
    try:
        await render_turn(state, plan)
    except InvalidRequest as exc:
        if exc.code != "context_length_exceeded":
            raise
        plan.finish_reason = "length"  # the conversation outgrew the context: as a length stop
        return False
    return True


__all__ = ["CLOSE_TIMEOUT", "begin", "turns"]
