"""The Responses API on the shared pipeline: prepare (items, chain, conversation → Harmony), then the
same select/build/dispatch stages as chat, then Responses items/events, storage and background mode.

Harmony prompt for a turn = system + developer (this request's instructions and tools only) + the
stored history of every response in the `previous_response_id` chain (oldest first) or the
conversation's items + this request's input. Each stored response keeps its own turn's messages
(input and generated, exactly as generated) so chains replay losslessly.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..api.schemas.responses import ResponsesRequest
from ..errors import Conflict, GatewayError, InvalidRequest, NotFound
from ..harmony import token_parser as tp
from ..harmony.encoding import ASSISTANT_STOP_IDS
from ..harmony.messages import (
    FunctionTool,
    Msg,
    PromptPrefix,
    ToolNamespace,
    dedupe_function_tools,
    drop_old_analysis,
    parse_reasoning_effort,
)
from ..storage.base import StoredResponse
from .background import RUNNER_KEY
from .context import GatewayState, PreparedRequest, RequestContext
from .parse_output import parse_chunk
from .prepare import (
    apply_tool_choice,
    render_harmony,
    sampling_options,
    selection_text,
    system_options,
    token_budget,
)
from .responses_input import call_names_of, items_to_messages, new_id, normalize_items
from .responses_output import ResponseBuilder, usage_of
from .run import _open_stream

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ResponsePlan:
    request: ResponsesRequest
    response_id: str
    owner: str
    prepared: PreparedRequest
    input_items: list[dict[str, Any]]
    turn_messages: list[Msg]
    envelope: dict[str, Any]
    conversation_id: str | None
    generated: list[Msg] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None


def client_namespaces(tools: list[dict[str, Any]] | None) -> list[ToolNamespace]:
    """`namespace` tools: client-side functions grouped under a name; the model calls `NAMESPACE.TOOL`,
    which Harmony renders natively as a tool namespace in the developer message."""
    out = []
    for i, tool in enumerate(tools or ()):
        if tool.get("type") != "namespace":
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name or name == "functions":
            raise InvalidRequest(
                "namespace tools need a 'name' other than 'functions'", param=f"tools[{i}].name"
            )
        members = function_tools(tool.get("tools") or [], param=f"tools[{i}].tools")
        out.append(ToolNamespace(name, tool.get("description") or "", tuple(members)))
    return out


def function_tools(tools: list[dict[str, Any]] | None, *, param: str = "tools") -> list[FunctionTool]:
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind == "namespace" and param == "tools":
            continue
        if kind != "function":
            raise InvalidRequest(
                f"tool type {kind!r} is not supported yet on this gateway; use function tools",
                param=f"{param}[{i}].type",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("function tools need a 'name'", param=f"{param}[{i}].name")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequest(
                "function parameters must be a JSON schema object", param=f"tools[{i}].parameters"
            )
        out.append(FunctionTool(name, tool.get("description") or "", params))
    return dedupe_function_tools(out)


def _envelope(
    req: ResponsesRequest, response_id: str, created_at: int, model: str, effort: str
) -> dict[str, Any]:
    conversation_id = req.conversation_id()
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "background": req.background,
        "conversation": {"id": conversation_id} if conversation_id else None,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},
        "store": req.store,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
    }


async def prepare_responses(state: GatewayState, req: ResponsesRequest, ctx: RequestContext) -> ResponsePlan:
    store = state.store
    if req.background and not req.store:
        raise InvalidRequest("background responses must be stored: set store to true", param="background")
    conversation_id = req.conversation_id()
    if req.conversation is not None and conversation_id is None:
        raise InvalidRequest("conversation must be an id or an object with an id", param="conversation")
    if conversation_id and req.previous_response_id:
        raise InvalidRequest(
            "conversation and previous_response_id cannot be used together", param="previous_response_id"
        )
    group = state.fleet.group(req.model)
    ctx.model = group.name
    if not group.harmony:
        raise InvalidRequest(
            f"the Responses API serves Harmony models; {group.name!r} is not one", param="model"
        )
    effort = parse_reasoning_effort(req.reasoning.effort if req.reasoning else None, param="reasoning.effort")
    tools = apply_tool_choice(function_tools(req.tools), req.tool_choice)
    namespaces = client_namespaces(req.tools) if req.tool_choice != "none" else []
    items = normalize_items(req.input)

    # History: the previous_response_id chain, or the conversation's items.
    history: list[Msg] = []
    known_items: list[dict[str, Any]] = []
    if req.previous_response_id:
        chain = await store.load_chain(req.previous_response_id, ctx.owner)
        for record in chain:
            history.extend(Msg.from_dict(d) for d in record.history)
            known_items.extend(record.input_items)
            known_items.extend(record.response.get("output") or ())
    conversation_items: list[dict[str, Any]] = []
    if conversation_id:
        found = await store.all_conversation_items(conversation_id, ctx.owner)
        if found is None:
            raise NotFound(f"Conversation with id {conversation_id!r} not found", param="conversation")
        conversation_items = found
        known_items.extend(found)
    call_names = call_names_of([*known_items, *items])
    by_id = {item.get("id"): item for item in known_items if item.get("id")}

    def resolve(item_id: str, where: str) -> dict[str, Any]:
        item = by_id.get(item_id)
        if item is None:
            raise NotFound(f"item {item_id!r} not found", param=f"{where}.id")
        return item

    if conversation_items:
        history.extend(items_to_messages(conversation_items, call_names, param="conversation"))
    extra_instructions: list[str] = []
    turn = items_to_messages(
        items,
        call_names,
        leading_instructions=extra_instructions,
        resolve_reference=resolve,
    )
    instructions = "\n\n".join(x for x in [req.instructions, *extra_instructions] if x) or None
    full_history = drop_old_analysis(history + turn)
    prefix = PromptPrefix(system_options(state, effort), instructions, tuple(tools), tuple(namespaces))
    input_ids = await render_harmony(state, prefix, full_history)

    sampling = sampling_options(group, temperature=req.temperature, top_p=req.top_p)
    sampling.max_new_tokens = token_budget(group, len(input_ids), req.max_output_tokens, param="input")
    sampling.stop_token_ids = list(ASSISTANT_STOP_IDS)
    prepared = PreparedRequest(
        group=group,
        input_ids=input_ids,
        sampling=sampling,
        selection_text=selection_text(full_history),
        stream=req.stream,
        function_names=frozenset(
            [t.name for t in tools] + [f"{ns.name}.{t.name}" for ns in namespaces for t in ns.tools]
        ),
        effort=effort,
        prefix=prefix,
        history=full_history,
        max_reasoning_tokens=req.reasoning.max_tokens if req.reasoning else None,
        original_text="[harmony]",
    )
    response_id = "resp_" + ctx.request_id if ctx.request_id.isalnum() else new_id("resp")
    if ctx.routing_key is None:
        ctx.routing_key = conversation_id or req.previous_response_id or req.user
    envelope = _envelope(req, response_id, int(time.time()), group.name, effort)
    return ResponsePlan(
        request=req,
        response_id=response_id,
        owner=ctx.owner,
        prepared=prepared,
        input_items=items,
        turn_messages=turn,
        envelope=envelope,
        conversation_id=conversation_id,
    )


def _generated_messages(parser: tp.HarmonyOutputParser) -> list[Msg]:
    out = []
    for msg in parser.messages:
        if msg.kind == tp.DROPPED:
            continue
        out.append(
            Msg(
                "assistant",
                msg.text,
                channel=msg.channel,
                recipient=msg.recipient,
                content_type=msg.content_type,
            )
        )
    return out


async def generate(
    state: GatewayState,
    plan: ResponsePlan,
    ctx: RequestContext,
    builder: ResponseBuilder,
    opened: tuple[AsyncIterator[Any], Any] | None = None,
) -> AsyncIterator[bytes]:
    """Run the model for this response, feeding the builder; yields stream frames as they form.

    One generation today; gateway-executed tools (MCP, built-ins) extend this into a loop."""
    prepared = plan.prepared
    parser = tp.HarmonyOutputParser(state.encoding, prepared.function_names, prepared.tool_namespaces)
    if opened is None:
        opened = await _open_stream(state, prepared, ctx, stream=True)
    chunks, first = opened
    async with contextlib.aclosing(chunks):
        if first is not None:
            _account(plan, first)
            builder.on_events(parse_chunk(parser, first))
        if builder.stream:
            out = builder.take()
            if out:
                yield out
        async for chunk in chunks:
            _account(plan, chunk)
            builder.on_events(parse_chunk(parser, chunk))
            if builder.stream:
                out = builder.take()
                if out:
                    yield out
    if not parser.output_tokens and first is None:
        builder.on_events(parser.finish())
    plan.reasoning_tokens += parser.reasoning_tokens
    plan.generated.extend(_generated_messages(parser))


def _account(plan: ResponsePlan, chunk: Any) -> None:
    if chunk.prompt_tokens:
        plan.input_tokens = chunk.prompt_tokens
    if chunk.completion_tokens:
        plan.output_tokens = chunk.completion_tokens
    if chunk.cached_tokens:
        plan.cached_tokens = chunk.cached_tokens
    if chunk.finished:
        plan.finish_reason = chunk.finish_reason


def _finish(plan: ResponsePlan, builder: ResponseBuilder) -> dict[str, Any]:
    builder.usage = usage_of(
        plan.input_tokens or len(plan.prepared.input_ids),
        plan.output_tokens,
        plan.reasoning_tokens,
        plan.cached_tokens,
    )
    if plan.finish_reason == "length":
        return builder.finish("incomplete", incomplete_reason="max_output_tokens")
    return builder.finish("completed")


def _record(plan: ResponsePlan, body: dict[str, Any], *, background: bool = False) -> StoredResponse:
    metadata: dict[str, Any] = {}
    return StoredResponse(
        id=plan.response_id,
        owner=plan.owner,
        created_at=body["created_at"],
        updated_at=time.time(),
        status=body["status"],
        model=body["model"],
        response=body,
        input_items=plan.input_items,
        history=[m.to_dict() for m in (*plan.turn_messages, *plan.generated)],
        previous_response_id=plan.request.previous_response_id,
        conversation_id=plan.conversation_id,
        background=background,
        request=plan.request.model_dump(exclude_none=True),
        metadata=metadata,
    )


async def persist(
    state: GatewayState, plan: ResponsePlan, body: dict[str, Any], *, background: bool = False
) -> None:
    """Store the response (before it is reported complete) and extend its conversation."""
    if plan.request.store:
        record = _record(plan, body, background=background)
        if background:
            record.metadata[RUNNER_KEY] = state.background.runner_id
        await state.store.put_response(record)
    if plan.conversation_id:
        added = await state.store.add_conversation_items(
            plan.conversation_id, plan.owner, [*plan.input_items, *body["output"]]
        )
        if added is None:
            raise NotFound(f"Conversation with id {plan.conversation_id!r} not found", param="conversation")


async def run_responses(
    state: GatewayState, req: ResponsesRequest, ctx: RequestContext
) -> dict[str, Any] | AsyncIterator[bytes]:
    # 1) prepare: items, chain or conversation, Harmony prompt
    plan = await prepare_responses(state, req, ctx)
    ctx.prompt_tokens = len(plan.prepared.input_ids)
    if req.background:
        return await start_background(state, plan, ctx)
    # 2) select, 3) build, 4) dispatch: wait for the first chunk so early failures are HTTP errors.
    # A non-stream response takes the engine's output in one message: one gRPC message instead of one
    # per token, the same tokens.
    opened = await _open_stream(state, plan.prepared, ctx, stream=req.stream)
    builder = ResponseBuilder(plan.envelope, stream=req.stream)
    if not req.stream:
        # 5) parse, 6) respond
        async for _ in generate(state, plan, ctx, builder, opened):
            pass
        body = _finish(plan, builder)
        ctx.completion_tokens = plan.output_tokens
        await persist(state, plan, body)
        return body
    return _stream(state, plan, ctx, builder, opened)


async def _stream(
    state: GatewayState, plan: ResponsePlan, ctx: RequestContext, builder: ResponseBuilder, opened: Any
) -> AsyncIterator[bytes]:
    builder.start()
    yield builder.take()
    try:
        async for piece in generate(state, plan, ctx, builder, opened):
            yield piece
        body = _finish(plan, builder)
        ctx.completion_tokens = plan.output_tokens
        terminal = builder.frames.pop()  # stored before the client hears it is complete
        await persist(state, plan, body)
        yield builder.take() + terminal
    except GatewayError as exc:
        ctx.status = exc.status_code
        builder.take()
        builder.finish("failed", error={"code": "server_error", "message": exc.message})
        yield builder.take()
    except Exception as exc:
        log.exception("responses stream failed", exc_info=exc)
        ctx.status = 500
        builder.take()
        builder.finish("failed", error={"code": "server_error", "message": "internal error while generating"})
        yield builder.take()


# -- background ------------------------------------------------------------------------------------
async def start_background(
    state: GatewayState, plan: ResponsePlan, ctx: RequestContext
) -> dict[str, Any] | AsyncIterator[bytes]:
    builder = ResponseBuilder(plan.envelope, stream=False)
    queued = builder.snapshot("queued")
    await persist_status(state, plan, queued)
    state.background.start(plan.response_id, _run_background(state, plan, ctx))
    return queued


async def persist_status(state: GatewayState, plan: ResponsePlan, body: dict[str, Any]) -> None:
    record = _record(plan, body, background=True)
    record.metadata[RUNNER_KEY] = state.background.runner_id
    await state.store.put_response(record)


async def _run_background(state: GatewayState, plan: ResponsePlan, ctx: RequestContext) -> None:
    builder = ResponseBuilder(plan.envelope, stream=False)
    try:
        await persist_status(state, plan, builder.snapshot("in_progress"))
        async for _ in generate(state, plan, ctx, builder):
            pass
        body = _finish(plan, builder)
        await persist(state, plan, body, background=True)
    except BaseException as exc:
        import asyncio

        if isinstance(exc, asyncio.CancelledError):
            body = builder.finish("cancelled")
            body["status"] = "cancelled"
            with contextlib.suppress(Exception):
                await asyncio.shield(persist_status(state, plan, body))
            raise
        message = exc.message if isinstance(exc, GatewayError) else "internal error while generating"
        if not isinstance(exc, GatewayError):
            log.exception("background response %s failed", plan.response_id, exc_info=exc)
        body = builder.finish("failed", error={"code": "server_error", "message": message})
        await persist_status(state, plan, body)


async def cancel_response(state: GatewayState, response_id: str, owner: str) -> dict[str, Any]:
    record = await state.store.get_response(response_id, owner)
    if record is None:
        raise NotFound(f"Response with id {response_id!r} not found", param="response_id")
    if not record.background:
        raise InvalidRequest("Cannot cancel a synchronous response.", param="response_id")
    if record.status == "cancelled":
        return record.response
    if record.status not in ("queued", "in_progress"):
        raise InvalidRequest(f"Cannot cancel a response with status {record.status!r}.", param="response_id")
    if not await state.background.cancel(response_id):
        raise Conflict("the response is running on another gateway replica", param="response_id")
    record = await state.store.get_response(response_id, owner)
    assert record is not None
    return record.response
