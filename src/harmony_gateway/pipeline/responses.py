"""The Responses API on the shared pipeline: prepare (items, chain, conversation → Harmony), then the
same select/build/dispatch stages as chat, then Responses items/events, storage and background mode.

Harmony prompt for a turn = system + developer (this request's instructions and tools only) + the
stored history of every response in the `previous_response_id` chain (oldest first) or the
conversation's items + this request's input. Each stored response keeps its own turn's messages
(input and generated, exactly as generated) so chains replay losslessly.

Gateway-executed tools (MCP servers, the `browser` / `python` built-ins; REFERENCE §5) turn one
generation into a loop: tools are listed before generation (`mcp_list_tools` items, once per chain),
each call the model makes is run (`mcp_call` / `web_search_call` / `code_interpreter_call` items), the
call and its result are appended to the conversation, and the model generates again on the same worker
with the remaining output budget, until a final answer, a function call, an approval request, length,
or the `max_tool_calls` limit. All iterations stream into one response with one terminal event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..api.schemas.responses import ResponsesRequest
from ..engines.base import EngineChunk
from ..errors import Conflict, GatewayError, InvalidRequest, NotFound
from ..harmony import token_parser as tp
from ..harmony.encoding import ASSISTANT_STOP_IDS, FIRST_SPECIAL_ID
from ..harmony.messages import (
    FunctionTool,
    Msg,
    PromptPrefix,
    ToolNamespace,
    dedupe_function_tools,
    drop_old_analysis,
    parse_reasoning_effort,
    tool_result,
)
from ..mcp.approval import ApprovalDecision, declined_text, match_approvals
from ..mcp.client import McpTool
from ..mcp.tool_loop import (
    APPROVAL,
    GATEWAY_TOOL_TYPES,
    OVER_LIMIT,
    GatewayTools,
    ToolLoop,
    open_tool_loop,
    parse_gateway_tools,
)
from ..observability.tracing import traced
from ..storage.base import MAX_CONVERSATION_ITEMS, StoredResponse
from .background import ACTIVE_STATUSES, RUNNER_KEY
from .client_tools import CLIENT_TOOL_KINDS, client_tool
from .context import GatewayState, PreparedRequest, RequestContext, detached_context, run_cleanups
from .dispatch import dispatch
from .hosted_tools import DROPPED_TOOL, backed_builtins, offered_tools
from .parse_output import feed_chunk, parse_chunk
from .prepare import (
    apply_tool_choice,
    forces_tool_call,
    output_constraint,
    prompt_cache_key_of,
    render_harmony,
    response_format_of,
    sampling_options,
    selection_text,
    system_options,
    token_budget,
    utc_date,
)
from .reasoning_budget import budget_exceeded, with_reasoning_budget
from .reasoning_store import vault_for, wants_encrypted_reasoning
from .responses_events import EventFeed, stream_stored_events
from .responses_input import McpReplay, call_names_of, items_to_messages, new_id, normalize_items
from .responses_output import ResponseBuilder, usage_of
from .run import _open_stream, await_first_chunk
from .text_upstream import require_token_engine

log = logging.getLogger(__name__)

#: Private `StoredResponse.metadata` key: the id of the first response of a `previous_response_id`
#: chain, inherited by every later one, so the whole chain routes by one key (never sent to clients).
ROOT_KEY = "_root"
#: Private `StoredResponse.metadata` key: the system message date of the chain's first turn, inherited.
DATE_KEY = "_date"

#: Seconds a cancelled request may spend closing its own MCP connections or writing its final state.
CLOSE_TIMEOUT = 5.0


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
    #: History before this turn (the chain's or the conversation's messages).
    history: list[Msg] = field(default_factory=list)
    #: Gateway-executed tools of this request (None: one plain generation).
    tools: ToolLoop | None = None
    #: Approval answers in this input, each with the placeholder tool message it fills in.
    approvals: list[tuple[ApprovalDecision, Msg]] = field(default_factory=list)
    iterations: int = 0
    #: True when the request offered gateway-executed tools (stays set after `close_tools`).
    uses_tools: bool = False
    #: Model turns that called tools past `max_tool_calls`; a second one ends the response incomplete.
    limit_turns: int = 0
    incomplete_reason: str | None = None
    #: The Harmony output parser of every iteration, for the Harmony metrics.
    parsers: list[tp.HarmonyOutputParser] = field(default_factory=list)
    #: The first response of this response's `previous_response_id` chain (its own id if it starts one).
    chain_root: str | None = None
    #: With `include: ["reasoning.encrypted_content"]`: seals each reasoning item's text (the builder's
    #: `seal_reasoning` hook).
    seal_reasoning: Callable[[str], str] | None = None

    async def close_tools(self) -> None:
        """Close the request's own MCP connections (pooled ones stay); idempotent."""
        if self.tools is not None:
            tools, self.tools = self.tools, None
            await tools.aclose()


async def conversation_started(store: Any, conversation_id: str, owner: str) -> str | None:
    conversation = await store.get_conversation(conversation_id, owner)
    return utc_date(conversation.created_at) if conversation is not None else None


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
    if not isinstance(tools, (list, type(None))):
        raise InvalidRequest("tools must be a list", param=param)
    out = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise InvalidRequest("tools must be objects", param=f"{param}[{i}]")
        if tool is DROPPED_TOOL:
            continue
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise InvalidRequest("tools need a string 'type'", param=f"{param}[{i}].type")
        if (kind == "namespace" or kind in GATEWAY_TOOL_TYPES) and param == "tools":
            continue  # namespaces: client_namespaces(); gateway-executed tools: mcp/tool_loop.py
        if kind in CLIENT_TOOL_KINDS and param == "tools":
            out.append(client_tool(tool, f"{param}[{i}]"))  # custom (freeform) and local_shell
            continue
        if kind != "function":
            raise InvalidRequest(
                f"tool type {kind!r} is not supported on this gateway; use function, custom, local_shell, "
                "namespace, mcp, web_search_preview or code_interpreter tools",
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
        out.append(FunctionTool(name, tool.get("description") or "", params, f"{param}[{i}]"))
    return dedupe_function_tools(out)


_SECRET_TOOL_KEYS = ("headers", "authorization")


def redacted_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools without MCP headers and authorization: echoed and stored, never secrets."""
    return [
        {k: v for k, v in tool.items() if k not in _SECRET_TOOL_KEYS} if tool.get("type") == "mcp" else tool
        for tool in tools or ()
    ]


def function_tool_choice(tool_choice: Any, has_gateway_tools: bool) -> Any:
    """The part of tool_choice that applies to function tools: a hosted-tool choice (`{"type": "mcp"}`,
    `{"type": "web_search_preview"}`) leaves functions on auto, as does `required` with gateway tools."""
    if isinstance(tool_choice, dict) and str(tool_choice.get("type")) in GATEWAY_TOOL_TYPES:
        return None
    if tool_choice == "required" and has_gateway_tools:
        return None
    return tool_choice


def listed_tools(items: list[dict[str, Any]]) -> dict[str, list[McpTool]]:
    """Tool listings already reported in a chain or conversation, by server label (smg#1163: list once)."""
    out: dict[str, list[McpTool]] = {}
    for item in items:
        if item.get("type") == "mcp_list_tools" and not item.get("error") and item.get("server_label"):
            tools = item.get("tools") or ()
            out[item["server_label"]] = [McpTool.from_item(t) for t in tools if isinstance(t, dict)]
    return out


#: The `include` value that asks for answer-token logprobs. Other values are accepted and ignored:
#: gpt-oss has nothing to put there (Codex sends `reasoning.encrypted_content`).
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def wants_logprobs(req: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (req.include or ())


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
        "tools": redacted_tools(req.tools),
        "top_logprobs": req.top_logprobs,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
    }


@traced("gateway.prepare")
async def prepare_responses(state: GatewayState, req: ResponsesRequest, ctx: RequestContext) -> ResponsePlan:
    """Validate, load the chain or conversation, map items to Harmony, and open the request's tools
    (connect, list: failures are HTTP errors). The prompt is rendered by `begin`. On any error the tools
    opened so far are closed."""
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
    ctx.prompt_cache_key = prompt_cache_key_of(req)
    if not group.harmony:
        raise InvalidRequest(
            f"the Responses API serves Harmony models; {group.name!r} is not one", param="model"
        )
    require_token_engine(group, "the Responses API", "use /v1/chat/completions or /v1/messages")
    effort = parse_reasoning_effort(req.reasoning.effort if req.reasoning else None, param="reasoning.effort")
    offered = offered_tools(req.tools, backed_builtins(state.mcp), state.settings.unbacked_tools, ctx.metrics)
    requested = parse_gateway_tools(offered) if req.tool_choice != "none" else GatewayTools()
    tools = apply_tool_choice(function_tools(offered), function_tool_choice(req.tool_choice, bool(requested)))
    namespaces = client_namespaces(req.tools) if req.tool_choice != "none" else []
    for spec in requested.mcp:
        if any(ns.name == spec.label for ns in namespaces):
            raise InvalidRequest(
                f"server_label {spec.label!r} is also the name of a namespace tool",
                param=f"{spec.param}.server_label",
            )
    items = normalize_items(req.input)

    # History: the previous_response_id chain, or the conversation's items.
    history: list[Msg] = []
    started: str | None = None  # the date the chain or conversation started: the prompt keeps it
    known_items: list[dict[str, Any]] = []
    chain_root: str | None = None
    if req.previous_response_id:
        chain = await store.load_chain(req.previous_response_id, ctx.owner)
        if chain[-1].status in ("queued", "in_progress"):
            # Its output is not known yet: continuing now would silently drop it from the history.
            raise Conflict(
                f"Previous response with id {req.previous_response_id!r} is still {chain[-1].status}; "
                "continue from it once it has finished",
                param="previous_response_id",
                code="previous_response_in_progress",
            )
        # Inherited along the chain, so it survives load_chain dropping the oldest ancestors.
        chain_root = chain[-1].metadata.get(ROOT_KEY) or chain[0].id
        started = chain[-1].metadata.get(DATE_KEY) or utc_date(chain[0].created_at)
        for record in chain:
            history.extend(Msg.from_dict(d) for d in record.history)
            known_items.extend(record.input_items)
            known_items.extend(record.response.get("output") or ())
    conversation_items: list[dict[str, Any]] = []
    if conversation_id:
        found = await store.all_conversation_items(conversation_id, ctx.owner)
        if found is None:
            raise NotFound(f"Conversation with id {conversation_id!r} not found", param="conversation")
        if len(found) + len(items) > MAX_CONVERSATION_ITEMS:
            raise InvalidRequest(
                f"conversation {conversation_id!r} holds {len(found)} items; a conversation holds at most "
                f"{MAX_CONVERSATION_ITEMS}: start a new one",
                param="conversation",
            )
        conversation_items = found
        known_items.extend(found)
        started = await conversation_started(store, conversation_id, ctx.owner)
    call_names = call_names_of([*known_items, *items])
    by_id = {item.get("id"): item for item in known_items if item.get("id")}

    def resolve(item_id: str, where: str) -> dict[str, Any]:
        item = by_id.get(item_id)
        if item is None:
            raise NotFound(f"item {item_id!r} not found", param=f"{where}.id")
        return item

    if conversation_items:
        history.extend(
            items_to_messages(conversation_items, call_names, param="conversation", mcp_replay=McpReplay())
        )
    decisions = match_approvals(items, known_items)
    approvals = []
    placeholders: dict[str, Msg] = {}
    for decision in decisions:
        request = decision.request
        # Filled in by `begin` once the call ran (or was declined); its position is the response's.
        placeholder = tool_result(f"{request.get('server_label')}.{request.get('name')}", "")
        placeholders[decision.request_id] = placeholder
        approvals.append((decision, placeholder))
    extra_instructions: list[str] = []
    vault = await vault_for(state, req.include, items, conversation_items)
    turn = items_to_messages(
        items,
        call_names,
        leading_instructions=extra_instructions,
        resolve_reference=resolve,
        mcp_replay=McpReplay(placeholders),
        open_reasoning=vault.open if vault is not None else None,
    )
    instructions = "\n\n".join(x for x in [req.instructions, *extra_instructions] if x) or None

    loop: ToolLoop | None = None
    if requested or decisions:
        max_calls = state.settings.max_tool_calls
        if req.max_tool_calls is not None:
            max_calls = min(max_calls, req.max_tool_calls)
        loop = await open_tool_loop(
            state.mcp,
            requested,
            max_calls=max_calls,
            listed=listed_tools(known_items),
            new_id=new_id,
            metrics=state.metrics,
        )
    try:
        for decision in decisions:
            label = decision.request.get("server_label")
            if decision.approve and (loop is None or label not in loop.servers):
                raise InvalidRequest(
                    f"approving a call to MCP server {label!r} needs that server among this request's tools",
                    param=f"input[{decision.position}]",
                )
        mcp_namespaces = loop.namespaces if loop is not None else ()
        options = system_options(
            state,
            effort,
            browser=loop is not None and loop.browser is not None,
            python=loop is not None and loop.python is not None,
            started=started,
        )
        response_format = response_format_of(
            (req.text or {}).get("format"), param="text.format", nested=False
        )
        prefix = PromptPrefix(
            options, instructions, tuple(tools), (*namespaces, *mcp_namespaces), response_format
        )
        sampling = sampling_options(group, temperature=req.temperature, top_p=req.top_p)
        sampling.stop_token_ids = list(ASSISTANT_STOP_IDS)
        sampling.structural_tag = output_constraint(
            tools if forces_tool_call(req.tool_choice) else (), response_format
        )
        sampling.constraint_param = "tool_choice" if forces_tool_call(req.tool_choice) else "text.format"
        prepared = PreparedRequest(
            group=group,
            input_ids=[],
            sampling=sampling,
            selection_text="",
            stream=req.stream,
            function_names=frozenset(
                [t.name for t in tools] + [f"{ns.name}.{t.name}" for ns in namespaces for t in ns.tools]
            ),
            tool_namespaces=loop.tool_namespaces if loop is not None else frozenset(),
            effort=effort,
            prefix=prefix,
            max_reasoning_tokens=req.reasoning.max_tokens if req.reasoning else None,
            original_text="[harmony]",
            # Answer-token logprobs only when included (`top_logprobs` alone is echoed, as OpenAI does).
            return_logprob=wants_logprobs(req),
            top_logprobs=(req.top_logprobs or 0) if wants_logprobs(req) else 0,
        )
        # Never derived from x-request-id: a client may reuse one, and a stored response must not be overwritten.
        response_id = new_id("resp")
        if chain_root is None and req.store and not conversation_id:
            chain_root = response_id  # a stored response may start a chain: route it as its followers
        if ctx.routing_key is None:
            # previous_response_id changes every turn; the chain's root does not, so the whole chain
            # stays on one worker's KV cache (consistent_hash).
            ctx.routing_key = chain_root or conversation_id or req.user
        envelope = _envelope(req, response_id, int(time.time()), group.name, effort)
        plan = ResponsePlan(
            request=req,
            response_id=response_id,
            owner=ctx.owner,
            prepared=prepared,
            input_items=items,
            turn_messages=turn,
            envelope=envelope,
            conversation_id=conversation_id,
            history=history,
            tools=loop,
            approvals=approvals,
            uses_tools=loop is not None,
            chain_root=chain_root,
            seal_reasoning=vault.seal
            if vault is not None and wants_encrypted_reasoning(req.include)
            else None,
        )
        if not approvals:
            await render_turn(state, plan)  # early: a prompt over the context is a 400, not a stream
        return plan
    except BaseException:
        if loop is not None:
            await loop.aclose()
        raise


def _generated_messages(parser: tp.HarmonyOutputParser) -> list[Msg]:
    out = []
    for msg in parser.messages:
        if msg.kind == tp.DROPPED:
            continue
        # Reasoning from an unknown channel or a broken header replays as plain analysis (so the drop rule
        # applies to it), never with the junk channel name.
        channel = "analysis" if msg.kind == tp.REASONING and not msg.recipient else msg.channel
        out.append(
            Msg(
                "assistant",
                msg.text,
                channel=channel,
                recipient=msg.recipient,
                content_type=msg.content_type,
            )
        )
    return out


def remaining_budget(plan: ResponsePlan) -> int | None:
    """`max_output_tokens` left for the next iteration (vllm#38226: the budget covers the whole loop)."""
    limit = plan.request.max_output_tokens
    return None if limit is None else limit - plan.output_tokens


async def render_turn(state: GatewayState, plan: ResponsePlan) -> None:
    """Render the conversation so far (history, this input, what this response generated and ran)."""
    prepared = plan.prepared
    assert prepared.prefix is not None
    full = drop_old_analysis(plan.history + plan.turn_messages + plan.generated)
    input_ids = await render_harmony(state, prepared.prefix, full)
    budget = token_budget(prepared.group, len(input_ids), remaining_budget(plan), param="input")
    plan.prepared = dataclasses.replace(
        prepared,
        input_ids=input_ids,
        sampling=dataclasses.replace(prepared.sampling, max_new_tokens=budget),
        selection_text=prepared.selection_text or selection_text(full),
        history=full,
        max_reasoning_tokens=remaining_reasoning(plan),
    )


def remaining_reasoning(plan: ResponsePlan) -> int | None:
    """`reasoning.max_tokens` left for the next iteration: like `max_output_tokens`, the budget covers
    the whole tool loop. Once spent, later iterations may reason one token before they must answer."""
    reasoning = plan.request.reasoning
    limit = reasoning.max_tokens if reasoning is not None else None
    return None if limit is None else max(limit - plan.reasoning_tokens, 1)


async def begin(state: GatewayState, plan: ResponsePlan, builder: ResponseBuilder) -> None:
    """Before the first generation: report the tool listings, run the calls this input approves (or tell
    the model they were declined), and render the prompt."""
    loop = plan.tools
    if loop is not None:
        for item in loop.list_items():
            builder.add_list_tools(item)
    if not plan.approvals:
        return
    for decision, placeholder in plan.approvals:
        request = decision.request
        recipient = f"{request.get('server_label')}.{request.get('name')}"
        arguments = str(request.get("arguments") or "")
        if decision.approve and loop is not None:
            call = loop.resolve(recipient)
            loop.calls += 1
            slot = builder.open_approved_call(
                str(request.get("server_label")), str(request.get("name")), arguments, decision.request_id
            )
            outcome = await loop.execute(call, arguments)
            builder.complete_tool(slot, outcome.output, outcome.error)
            text = outcome.model_text
        else:
            text = declined_text(decision.reason)
        filled = placeholder._replace(text=text)
        plan.turn_messages = [filled if m is placeholder else m for m in plan.turn_messages]
    await render_turn(state, plan)


async def _open_iteration(
    state: GatewayState, plan: ResponsePlan, ctx: RequestContext, pinned: Any
) -> tuple[AsyncIterator[Any], Any]:
    """Dispatch one iteration and wait for its first chunk; later iterations stay on `pinned` (its
    prefix cache holds the conversation) while it is available."""
    if pinned is None:
        return await _open_stream(state, plan.prepared, ctx, stream=True)
    dispatched = dispatch(state, plan.prepared, ctx, stream=True, pinned=pinned)
    return await await_first_chunk(with_reasoning_budget(state, plan.prepared, ctx, dispatched))


async def generate(
    state: GatewayState,
    plan: ResponsePlan,
    ctx: RequestContext,
    builder: ResponseBuilder,
    opened: tuple[AsyncIterator[Any], Any] | None = None,
) -> AsyncIterator[bytes]:
    """Run the model for this response, feeding the builder; yields stream frames as they form.

    Without gateway tools this is one generation. With them, each model turn that calls tools is
    followed by running the calls and generating again (REFERENCE §5.2); stop conditions: a turn
    without gateway calls, a function call, an approval request, length, or the second turn that
    calls tools after the model was told `max_tool_calls` is reached."""
    loop = plan.tools
    builder.tools = loop
    if plan.prepared.return_logprob and builder.token_text is None:
        builder.token_text = token_texts(state.encoding)
    pinned = None
    while True:
        plan.iterations += 1
        prepared = plan.prepared
        parser = tp.HarmonyOutputParser(state.encoding, prepared.function_names, prepared.tool_namespaces)
        plan.parsers.append(parser)
        if opened is None:
            opened = await _open_iteration(state, plan, ctx, pinned)
        chunks, first = opened
        opened = None
        usage = _Usage()
        async with contextlib.aclosing(chunks):
            if first is not None:
                usage.account(plan, first)
                _parse_into(builder, parser, first)
            if builder.ready():
                yield builder.take()
            async for chunk in chunks:
                usage.account(plan, chunk)
                _parse_into(builder, parser, chunk)
                if builder.ready():
                    yield builder.take()
        pinned = ctx.worker
        if not parser.output_tokens and first is None:
            builder.on_events(parser.finish())
        plan.input_tokens += usage.input_tokens or len(prepared.input_ids)
        plan.output_tokens += usage.output_tokens
        plan.cached_tokens += usage.cached_tokens
        plan.reasoning_tokens += parser.reasoning_tokens
        plan.generated.extend(_generated_messages(parser))
        if loop is None:
            return

        # Run this turn's calls in order; the builder holds later output until each call is reported.
        while builder.awaiting is not None:
            slot = builder.awaiting
            slot.outcome = await loop.execute(slot.decision, slot.msg.text)
            builder.complete_tool(slot, slot.outcome.output, slot.outcome.error)
            if builder.ready():
                yield builder.take()
        slots, builder.tool_slots = builder.tool_slots, []
        if plan.finish_reason == "length" or not slots:
            return
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
            return
        if over_limit:
            plan.limit_turns += 1
            if plan.limit_turns > 1:
                plan.incomplete_reason = "max_tool_calls"
                return
        remaining = remaining_budget(plan)
        if remaining is not None and remaining <= 0:
            plan.finish_reason = "length"
            return
        try:
            await render_turn(state, plan)
        except InvalidRequest as exc:
            if exc.code != "context_length_exceeded":
                raise
            plan.finish_reason = "length"  # the conversation outgrew the context: as a length stop
            return


def _parse_into(builder: ResponseBuilder, parser: tp.HarmonyOutputParser, chunk: EngineChunk) -> None:
    """Parse one engine chunk into the builder. With logprobs requested the tokens go in one at a time,
    so each answer token's logprob rides on the text delta it forms; only tokens of final and preamble
    text are reported, never analysis, tool-call or control tokens (REFERENCE §2.7). Stream and
    non-stream take this same path, so they report the same entries."""
    logprobs = chunk.logprobs
    if builder.token_text is None or not logprobs:
        builder.on_events(parse_chunk(parser, chunk))
        return
    for i, token in enumerate(chunk.token_ids):
        before = parser.open_message
        events = parser.feed((token,))
        if (
            token < FIRST_SPECIAL_ID
            and before is not None
            and before is parser.open_message
            and (before.kind == tp.ANSWER or before.kind == tp.PREAMBLE)
            and i < len(logprobs)
            and logprobs[i].token_id == token
        ):
            builder.add_logprob(before, logprobs[i])
        if events:
            builder.on_events(events)
    if chunk.finished:
        builder.on_events(feed_chunk(parser, dataclasses.replace(chunk, token_ids=[])))


def token_texts(encoding: Any) -> Callable[[int], str]:
    """A token id's text (for logprob entries), cached for the request."""
    cache: dict[int, str] = {}

    def text(token_id: int) -> str:
        found = cache.get(token_id)
        if found is None:
            found = cache[token_id] = encoding.decode([token_id])
        return found

    return text


@dataclass(slots=True)
class _Usage:
    """One iteration's engine counts (cumulative within an engine request)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0

    def account(self, plan: ResponsePlan, chunk: Any) -> None:
        if chunk.prompt_tokens:
            self.input_tokens = chunk.prompt_tokens
        if chunk.completion_tokens:
            self.output_tokens = chunk.completion_tokens
        if chunk.cached_tokens:
            self.cached_tokens = chunk.cached_tokens
        if chunk.finished:
            plan.finish_reason = chunk.finish_reason


def _finish(
    state: GatewayState, plan: ResponsePlan, builder: ResponseBuilder, ctx: RequestContext
) -> dict[str, Any]:
    builder.usage = usage_of(plan.input_tokens, plan.output_tokens, plan.reasoning_tokens, plan.cached_tokens)
    if plan.prepared.max_reasoning_tokens is not None:
        # As chat's completion_tokens_details.reasoning_budget_exceeded (pipeline/reasoning_budget.py).
        builder.usage["output_tokens_details"]["reasoning_budget_exceeded"] = budget_exceeded(ctx)
    if plan.uses_tools:
        _observe_iterations(state, plan)
    if plan.finish_reason == "length":
        return builder.finish("incomplete", incomplete_reason="max_output_tokens")
    if plan.incomplete_reason is not None:
        return builder.finish("incomplete", incomplete_reason=plan.incomplete_reason)
    return builder.finish("completed")


def _observe_iterations(state: GatewayState, plan: ResponsePlan) -> None:
    metrics = state.metrics
    if metrics is not None and hasattr(metrics, "mcp_iterations"):
        metrics.mcp_iterations.labels(plan.prepared.group.name).observe(plan.iterations)


def _record(plan: ResponsePlan, body: dict[str, Any], *, background: bool = False) -> StoredResponse:
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
        input_items=plan.input_items,
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
        record = _record(plan, body, background=background)
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
        added = await state.store.add_conversation_items(
            plan.conversation_id, plan.owner, [*new_inputs, *body["output"]]
        )
        if added is None:
            raise NotFound(f"Conversation with id {plan.conversation_id!r} not found", param="conversation")
    return True


async def run_responses(
    state: GatewayState, req: ResponsesRequest, ctx: RequestContext
) -> dict[str, Any] | AsyncIterator[bytes]:
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
        opened = await _open_stream(state, plan.prepared, ctx, stream=engine_stream)
    except BaseException:
        await plan.close_tools()
        raise
    if not req.stream:
        # 5) parse (and run tools), 6) respond
        try:
            async for _ in generate(state, plan, ctx, builder, opened):
                pass
        finally:
            await plan.close_tools()
        body = _finish(state, plan, builder, ctx)
        ctx.completion_tokens = plan.output_tokens
        await persist(state, plan, body)
        return body
    ctx.cleanups.append(plan.close_tools)  # also when the stream never starts (client gone early)
    return _stream(state, plan, ctx, builder, opened)


async def _stream(
    state: GatewayState, plan: ResponsePlan, ctx: RequestContext, builder: ResponseBuilder, opened: Any
) -> AsyncIterator[bytes]:
    try:
        yield builder.take()
        try:
            async for piece in generate(state, plan, ctx, builder, opened):
                yield piece
        finally:
            # A client that left cancels this generator, mid tool call too; the request's MCP
            # connections still close (shielded: the cancelled scope would cancel the close too).
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
                await plan.close_tools()
        body = _finish(state, plan, builder, ctx)
        ctx.completion_tokens = plan.output_tokens
        terminal = builder.frames.pop()  # stored before the client hears it is complete
        await persist(state, plan, body)
        yield builder.take() + terminal
    except GatewayError as exc:
        ctx.status = exc.status_code
        yield await _fail_stream(state, plan, builder, exc.message)
    except Exception as exc:
        log.exception("responses stream failed", exc_info=exc)
        ctx.status = 500
        yield await _fail_stream(state, plan, builder, "internal error while generating")


async def _fail_stream(
    state: GatewayState, plan: ResponsePlan, builder: ResponseBuilder, message: str
) -> bytes:
    """End a stream that failed after `response.created`: close the open items (incomplete), store the
    failed Response when `store` is set (OpenAI keeps failed responses; GET returns it), and return the
    closing frames, `response.failed` last. The conversation is not extended by a failed turn.

    A non-stream request that fails answers with the HTTP error instead and stores nothing: its client
    never learnt the response id."""
    builder.take()
    body = builder.finish("failed", error={"code": "server_error", "message": message})
    if plan.request.store:
        try:
            await state.store.put_response(_record(plan, body))
        except Exception as exc:
            log.warning("failed response %s could not be stored: %s", plan.response_id, exc)
    return builder.take()


# -- background ------------------------------------------------------------------------------------
async def start_background(
    state: GatewayState, plan: ResponsePlan, ctx: RequestContext
) -> dict[str, Any] | AsyncIterator[bytes]:
    """Store the response as queued, start its task and return at once: the queued Response, or with
    `stream` the live events (the caller is one more subscriber; leaving does not stop the task)."""
    builder = ResponseBuilder(plan.envelope, stream=False, record=True)
    builder.seal_reasoning = plan.seal_reasoning  # hook: encrypted reasoning items
    feed = EventFeed(plan.response_id, state.store)
    queued = builder.snapshot("queued")
    builder.announce_created("queued")
    await persist_status(state, plan, queued)
    await feed.publish(builder.take_events())
    await feed.flush()  # the log exists as soon as the response does
    # Its own context: the HTTP request's clean-up (the client leaving) must never close the engine
    # stream or tool connections this task still uses.
    task_ctx = detached_context(ctx)
    state.background.start(
        plan.response_id, _run_background(state, plan, task_ctx, builder, feed), feed, state.store
    )
    if plan.request.stream:
        return stream_stored_events(
            state.store,
            plan.response_id,
            plan.owner,
            -1,
            feed,
            idle_timeout=state.settings.timeouts.first_token,
        )
    return queued


#: A cancelled response may still be rewritten by its own task (with the output generated so far).
_CANCELLABLE = ACTIVE_STATUSES | {"cancelled"}


async def persist_status(
    state: GatewayState,
    plan: ResponsePlan,
    body: dict[str, Any],
    *,
    from_statuses: frozenset[str] | None = None,
) -> bool:
    """Store the background response's state; with `from_statuses`, only while its stored status is one
    of them (`Store.update_response_if`): False when another writer moved it on first."""
    record = _record(plan, body, background=True)
    record.metadata[RUNNER_KEY] = state.background.runner_id
    if from_statuses is None:
        await state.store.put_response(record)
        return True
    return await state.store.update_response_if(record, from_statuses)


async def _run_background(
    state: GatewayState, plan: ResponsePlan, ctx: RequestContext, builder: ResponseBuilder, feed: EventFeed
) -> None:
    """The response's task: every event goes to `feed` (live subscribers and the stored log); the final
    state is stored before the terminal event is published, on every path, cancellation included."""
    try:
        if not await persist_status(
            state, plan, builder.snapshot("in_progress"), from_statuses=frozenset({"queued"})
        ):
            await plan.close_tools()
            await _end_cancelled(state, plan, builder, feed)  # cancelled while queued
            return
        builder.announce_in_progress()
        await feed.publish(builder.take_events())
        try:
            await begin(state, plan, builder)
            async for _ in generate(state, plan, ctx, builder):
                await feed.publish(builder.take_events())
        finally:
            await plan.close_tools()
        body = _finish(state, plan, builder, ctx)
        if not await persist(state, plan, body, background=True):
            # A cancel was stored first: it stands, and the log ends as the store does.
            await _end_cancelled(state, plan, builder, feed)
            return
        await feed.publish(builder.take_events())
    except asyncio.CancelledError:
        # Cancelled: POST /cancel (here, or through the watcher when it reached another replica) or
        # shutdown. If the response already ended and that was stored, its own end stands.
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
            await _end_cancelled(state, plan, builder, feed)
        raise
    except Exception as exc:
        final = builder.final
        if final is None:
            message = exc.message if isinstance(exc, GatewayError) else "internal error while generating"
            if not isinstance(exc, GatewayError):
                log.exception("background response %s failed", plan.response_id, exc_info=exc)
            final = builder.finish("failed", error={"code": "server_error", "message": message})
        else:
            log.exception("background response %s could not be stored", plan.response_id, exc_info=exc)
        stored = False
        with contextlib.suppress(Exception):
            stored = await persist_status(state, plan, final, from_statuses=ACTIVE_STATUSES)
        if not stored:
            await _end_cancelled(state, plan, builder, feed)  # the stored cancel, if any, stands
            return
        await feed.publish(builder.take_events())
    finally:
        await run_cleanups(ctx)  # this task's own engine streams
        if state.metrics is not None:
            state.metrics.observe_harmony(plan.parsers)


async def _end_cancelled(
    state: GatewayState, plan: ResponsePlan, builder: ResponseBuilder, feed: EventFeed
) -> None:
    """End a background response as cancelled: store it with the output generated so far (unless an
    ending was stored first, which then stands) and publish the matching terminal event."""
    if builder.final is not None and builder.final["status"] != "cancelled":
        with contextlib.suppress(Exception):
            if await state.store.get_response_status(plan.response_id) == "cancelled":
                builder.retract_final()  # that ending lost the race to the stored cancel
    final = builder.final or builder.finish("cancelled")
    if final["status"] == "cancelled":
        try:
            await persist_status(state, plan, final, from_statuses=_CANCELLABLE)
        except Exception as exc:
            log.warning("cancelled response %s could not be stored: %s", plan.response_id, exc)
    await feed.publish(builder.take_events())


async def cancel_response(state: GatewayState, response_id: str, owner: str) -> dict[str, Any]:
    """Cancel a background response wherever it runs (REFERENCE §6.1).

    The stored response becomes `cancelled` through a conditional write, so a response whose ending was
    stored first is not touched (400, as for any finished response) and its task's later ending cannot
    undo the cancel. The task stops at once when it runs in this process; elsewhere its watcher
    (`background.watch_for_cancel`) reads the status within a poll interval. Either way the engine
    request is aborted, and the task then stores the cancelled Response with what it had generated.
    Returns the cancelled Response."""
    record = await state.store.get_response(response_id, owner)
    if record is None:
        raise NotFound(f"Response with id {response_id!r} not found", param="response_id")
    if not record.background:
        raise InvalidRequest("Cannot cancel a synchronous response.", param="response_id")
    if record.status in ACTIVE_STATUSES:
        record.status = "cancelled"
        record.updated_at = time.time()
        record.response = dict(
            record.response, status="cancelled", error=None, incomplete_details=None, completed_at=None
        )
        if await state.store.update_response_if(record, ACTIVE_STATUSES):
            if await state.background.cancel(response_id):
                stopped = await state.store.get_response(response_id, owner)
                return stopped.response if stopped is not None else record.response
            return record.response
        found = await state.store.get_response(response_id, owner)  # it ended (or was cancelled) first
        if found is None:
            raise NotFound(f"Response with id {response_id!r} not found", param="response_id")
        record = found
    if record.status == "cancelled":
        return record.response
    raise InvalidRequest(f"Cannot cancel a response with status {record.status!r}.", param="response_id")
