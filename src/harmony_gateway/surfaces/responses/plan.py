"""The Responses API's stage code: a request (items, `previous_response_id` chain or conversation,
tools) mapped to one Harmony turn, and each generation's output parsed into the response builder.

Harmony prompt for a turn = system + developer (this request's instructions and tools only) + the
stored history of the responses in the `previous_response_id` chain (oldest first) or the
conversation's items, as much of it as the context shows (`history_window`) + this request's input. Each stored response keeps its own turn's messages
(input and generated, exactly as generated) so chains replay losslessly.

What runs a response (the tool loop, storage, background runs, cancel) is the Responses service in
`harmony_gateway/responses/`; it drives generations through the shared stream driver.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...engines.base import EngineChunk, take_counts
from ...errors import Conflict, InvalidRequest, NotFound
from ...harmony import token_parser as tp
from ...harmony.encoding import FIRST_SPECIAL_ID
from ...harmony.messages import (
    FunctionTool,
    Msg,
    ToolNamespace,
    dedupe_function_tools,
    drop_old_analysis,
    parse_reasoning_effort,
    tool_result,
)
from ...mcp.approval import (
    APPROVAL_KEY_PURPOSE,
    ApprovalDecision,
    ApprovalIds,
    answers_approvals,
    match_approvals,
)
from ...mcp.client import McpTool
from ...mcp.tool_loop import (
    GATEWAY_TOOL_TYPES,
    GatewayTools,
    ToolLoop,
    open_tool_loop,
    parse_gateway_tools,
)
from ...observability.tracing import traced
from ...pipeline.context import GatewayState, PreparedRequest, RequestContext
from ...pipeline.hosted_tools import DROPPED_TOOL, backed_builtins, offered_tools
from ...pipeline.parse_output import feed_chunk, parse_chunk
from ...pipeline.prepare import (
    HarmonyTurn,
    apply_tool_choice,
    forces_tool_call,
    harmony_request,
    prompt_cache_key_of,
    render_prompt,
    renders_on_loop,
    response_format_of,
    sampling_options,
    utc_date,
)
from ...pipeline.reasoning_store import reasoning_vault, vault_for, wants_encrypted_reasoning
from ...storage.base import RecentChain, item_sizes, size_of
from ...types.limits import MAX_SCHEMA_CHARS, MAX_TOOL_DESCRIPTION_CHARS, schema_too_large
from ..chat.upstream import require_token_engine
from .client_tools import CLIENT_TOOL_KINDS, client_tool
from .compaction import compact_threshold, compacted, compacted_split, holds_summary
from .history_window import history_byte_budget, history_too_long, newest_that_fit, truncates
from .mapper import McpReplay, call_names_of, items_to_messages, new_id, normalize_items
from .objects import response_envelope, usage_of
from .output import ResponseBuilder
from .types import ResponsesRequest

log = logging.getLogger(__name__)

#: Private `StoredResponse.metadata` key: the id of the first response of a `previous_response_id`
#: chain, inherited by every later one, so the whole chain routes by one key (never sent to clients).
ROOT_KEY = "_root"
#: Private `StoredResponse.metadata` key: the system message date of the chain's first turn, inherited.
DATE_KEY = "_date"


class ChainReader(Protocol):
    """Where a turn reads its `previous_response_id` chain: the store (`Store.load_recent_chain`), or a
    WebSocket's own cache in front of it (`socket.SocketCache`)."""

    async def load_recent_chain(
        self, response_id: str, owner: str, *, max_bytes: int | None, max_depth: int = 100
    ) -> RecentChain: ...


@dataclass(slots=True, eq=False)
class Turn:
    """One generation of a response: its parser and the engine's counts so far."""

    parser: tp.HarmonyOutputParser
    chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


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
    #: The Harmony output parser of every iteration, for the Harmony metrics.
    parsers: list[tp.HarmonyOutputParser] = field(default_factory=list)
    #: The first response of this response's `previous_response_id` chain (its own id if it starts one).
    chain_root: str | None = None
    #: With `include: ["reasoning.encrypted_content"]`: seals each reasoning item's text (the builder's
    #: `seal_reasoning` hook).
    seal_reasoning: Callable[[str], str] | None = None
    #: The generation under way (None between generations).
    turn: Turn | None = None
    #: The items this input's `item_reference`s point at, by id.
    references: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: `context_management` compaction: the prompt size past which the conversation is compacted before
    #: a generation (service/turns.py `compact_if_due`); None without it.
    compact_threshold: int | None = None

    def messages(self) -> list[Msg]:
        """The conversation so far, as the model sees it: history, this input, what this response
        generated and ran, after compaction and the analysis drop rule."""
        return drop_old_analysis(compacted(self.history + self.turn_messages + self.generated))

    def listed_inputs(self) -> list[dict[str, Any]]:
        """The input items as `input_items` lists them: a reference as the item it points at."""
        if not self.references:
            return self.input_items
        return [
            self.references.get(item["id"], item) if item.get("type") == "item_reference" else item
            for item in self.input_items
        ]

    def start_turn(self, encoding: Any) -> Turn:
        """A new generation of this response: its own Harmony parser, counted in `iterations`."""
        prepared = self.prepared
        parser = tp.HarmonyOutputParser(encoding, prepared.function_names, prepared.tool_namespaces)
        self.parsers.append(parser)
        self.iterations += 1
        self.turn = Turn(parser)
        return self.turn

    def account(self, chunk: EngineChunk) -> None:
        """One engine chunk's counts (cumulative within an engine request) and finish reason."""
        turn = self.turn
        assert turn is not None
        turn.chunks += 1
        take_counts(turn, chunk)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason

    def end_turn(self, builder: ResponseBuilder) -> Turn:
        """Add the generation that just ended to the response: its counts and generated messages."""
        turn = self.turn
        assert turn is not None
        self.turn = None
        parser = turn.parser
        if not parser.output_tokens and not turn.chunks:
            builder.on_events(parser.finish())  # an empty stream: nothing else closes the parser
        self.input_tokens += turn.prompt_tokens or len(self.prepared.input_ids)
        self.output_tokens += turn.completion_tokens
        self.cached_tokens += turn.cached_tokens
        self.reasoning_tokens += parser.reasoning_tokens
        self.generated.extend(_generated_messages(parser))
        return turn

    def usage(self) -> dict[str, Any]:
        """The Response's `usage`: the tokens of the ended generations and of the one under way (a
        response that fails or is cancelled mid-generation reports what it used)."""
        input_tokens, output_tokens = self.input_tokens, self.output_tokens
        reasoning_tokens, cached_tokens = self.reasoning_tokens, self.cached_tokens
        turn = self.turn
        if turn is not None:
            input_tokens += turn.prompt_tokens
            output_tokens += turn.completion_tokens
            cached_tokens += turn.cached_tokens
            reasoning_tokens += turn.parser.reasoning_tokens
        return usage_of(input_tokens, output_tokens, reasoning_tokens, cached_tokens)

    def output_tokens_so_far(self) -> int:
        """Output tokens of the ended generations and of the one under way."""
        return self.output_tokens + (self.turn.completion_tokens if self.turn is not None else 0)

    async def close_tools(self) -> None:
        """Close the request's own MCP connections (pooled ones stay); idempotent."""
        if self.tools is not None:
            tools, self.tools = self.tools, None
            await tools.aclose()


async def approval_ids_of(state: GatewayState, owner: str) -> ApprovalIds:
    """The tenant's approval request ids, under a key derived from the gateway key (shared by replicas)."""
    vault = await reasoning_vault(state, owner)
    return ApprovalIds(vault.subkey(APPROVAL_KEY_PURPOSE), owner)


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
        out.append(ToolNamespace(name, tool_description(tool, f"tools[{i}]"), tuple(members)))
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
        if schema_too_large(params):
            raise InvalidRequest(
                f"function parameters are at most {MAX_SCHEMA_CHARS} characters as JSON",
                param=f"{param}[{i}].parameters",
            )
        out.append(FunctionTool(name, tool_description(tool, f"{param}[{i}]"), params, f"{param}[{i}]"))
    return dedupe_function_tools(out)


def tool_description(tool: dict[str, Any], where: str) -> str:
    """A Responses tool's `description`: a string of at most MAX_TOOL_DESCRIPTION_CHARS, else a 400."""
    description = tool.get("description")
    if description is None:
        return ""
    if not isinstance(description, str):
        raise InvalidRequest("tool descriptions must be strings", param=f"{where}.description")
    if len(description) > MAX_TOOL_DESCRIPTION_CHARS:
        raise InvalidRequest(
            f"tool descriptions are at most {MAX_TOOL_DESCRIPTION_CHARS} characters",
            param=f"{where}.description",
        )
    return description


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


@traced("gateway.prepare")
async def prepare_responses(
    state: GatewayState,
    req: ResponsesRequest,
    ctx: RequestContext,
    *,
    chains: ChainReader | None = None,
    render: bool = True,
) -> ResponsePlan:
    """Validate, load the chain (from `chains`, the store by default) or conversation, map items to
    Harmony, and open the request's tools (connect, list: failures are HTTP errors). The prompt is
    rendered here (a prompt over the context is a 400), or by `begin` when approved calls must run
    first; with `render=False` not at all (a compaction renders its own). On any error the tools opened
    so far are closed."""
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
    truncate = truncates(req.truncation)
    context_tokens = group.info.max_context_length
    threshold = compact_threshold(req.context_management, context_tokens)

    # History: the previous_response_id chain, or the conversation's items.
    history: list[Msg] = []
    started: str | None = None  # the date the chain or conversation started: the prompt keeps it
    known_items: list[dict[str, Any]] = []
    chain_root: str | None = None
    if req.previous_response_id:
        # Only the newest responses the context could show are read (surfaces/responses/history_window.py).
        recent_chain = await (chains or store).load_recent_chain(
            req.previous_response_id, ctx.owner, max_bytes=history_byte_budget(context_tokens)
        )
        chain = recent_chain.responses
        if recent_chain.omitted and not truncate and not any(holds_summary(r.history) for r in chain):
            # Older responses than a summary are left out anyway, but for their user messages.
            raise history_too_long(context_tokens)
        if chain[-1].status in ("queued", "in_progress"):
            # Its output is not known yet: continuing now would silently drop it from the history.
            raise Conflict(
                f"Previous response with id {req.previous_response_id!r} is still {chain[-1].status}; "
                "continue from it once it has finished",
                param="previous_response_id",
                code="previous_response_in_progress",
                retry_after=1.0,  # the one conflict that clears by itself: SDKs may retry it
            )
        # Inherited along the chain, so it survives the oldest ancestors being left unread.
        chain_root = chain[-1].metadata.get(ROOT_KEY) or chain[0].id
        started = chain[-1].metadata.get(DATE_KEY) or utc_date(chain[0].created_at)
        for record in chain:
            history.extend(Msg.from_dict(d) for d in record.history)
            known_items.extend(record.input_items)
            known_items.extend(record.response.get("output") or ())
    conversation_items: list[dict[str, Any]] = []
    if conversation_id:
        held = await store.conversation_size(conversation_id, ctx.owner)
        if held is None:
            raise NotFound(f"Conversation with id {conversation_id!r} not found", param="conversation")
        # This input joins the conversation when the response ends: refuse it now, not after generating.
        state.settings.conversation_limits.check(held, size_of(item_sizes(items)), param="conversation")
        # Only the newest items the context could show are read (surfaces/responses/history_window.py).
        recent = await store.recent_conversation_items(
            conversation_id, ctx.owner, max_bytes=history_byte_budget(context_tokens)
        )
        if recent is None:
            raise NotFound(f"Conversation with id {conversation_id!r} not found", param="conversation")
        if (
            recent.omitted
            and not truncate
            and not any(item.get("type") == "compaction" for item in recent.items)
        ):
            raise history_too_long(context_tokens)
        conversation_items = recent.items
        known_items.extend(conversation_items)
        started = await conversation_started(store, conversation_id, ctx.owner)
    call_names = call_names_of([*known_items, *items])
    by_id = {item.get("id"): item for item in known_items if item.get("id")}

    references: dict[str, dict[str, Any]] = {}

    def resolve(item_id: str, where: str) -> dict[str, Any]:
        item = by_id.get(item_id)
        if item is None:
            raise NotFound(f"item {item_id!r} not found", param=f"{where}.id")
        references[item_id] = item
        return item

    vault = await vault_for(state, ctx.owner, req.include, items, conversation_items)
    open_summary = vault.open_summary if vault is not None else None
    if conversation_items:
        history.extend(
            items_to_messages(
                conversation_items,
                call_names,
                param="conversation",
                mcp_replay=McpReplay(),
                open_summary=open_summary,
            )
        )
    approval_ids = await approval_ids_of(state, ctx.owner) if requested or answers_approvals(items) else None
    decisions = match_approvals(items, known_items, approval_ids) if approval_ids is not None else []
    approvals = []
    placeholders: dict[str, Msg] = {}
    for decision in decisions:
        request = decision.request
        # Filled in by `begin` once the call ran (or was declined); its position is the response's.
        placeholder = tool_result(f"{request.get('server_label')}.{request.get('name')}", "")
        placeholders[decision.request_id] = placeholder
        approvals.append((decision, placeholder))
    extra_instructions: list[str] = []
    turn = items_to_messages(
        items,
        call_names,
        leading_instructions=extra_instructions,
        resolve_reference=resolve,
        mcp_replay=McpReplay(placeholders),
        open_reasoning=vault.open if vault is not None else None,
        open_summary=open_summary,
    )
    # A summary (a compaction item, here or in the history) stands for what came before it.
    history, turn = compacted_split(history, turn)
    instructions = "\n\n".join(x for x in [req.instructions, *extra_instructions] if x) or None

    loop: ToolLoop | None = None
    if approval_ids is not None and (requested or decisions):
        max_calls = state.settings.max_tool_calls
        if req.max_tool_calls is not None:
            max_calls = min(max_calls, req.max_tool_calls)
        loop = await open_tool_loop(
            state.mcp,
            requested,
            max_calls=max_calls,
            listed=listed_tools(known_items),
            new_id=new_id,
            approval_ids=approval_ids,
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
        logprobs = wants_logprobs(req)
        mapped = HarmonyTurn(
            effort=effort,
            instructions=instructions,
            history=[],  # rendered by `render_turn`, with the chain's history and what runs meanwhile
            sampling=sampling_options(
                group,
                temperature=req.temperature,
                top_p=req.top_p,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
            ),
            tools=tuple(tools),
            namespaces=tuple(namespaces),
            gateway_namespaces=loop.namespaces if loop is not None else (),
            gateway_tool_names=loop.tool_namespaces if loop is not None else frozenset(),
            browser=loop is not None and loop.browser is not None,
            python=loop is not None and loop.python is not None,
            response_format=response_format_of(
                (req.text or {}).get("format"), param="text.format", nested=False
            ),
            forces_call=forces_tool_call(req.tool_choice),
            format_param="text.format",
            budget_param="input",
            stream=req.stream,
            max_reasoning_tokens=req.reasoning.max_tokens if req.reasoning else None,
            started=started,
            # Answer-token logprobs only when included (`top_logprobs` alone is echoed, as OpenAI does).
            return_logprob=logprobs,
            top_logprobs=(req.top_logprobs or 0) if logprobs else 0,
        )
        prepared = harmony_request(state, group, mapped)
        history = await fit_history(state, prepared, history, turn, truncate=truncate)
        # Never derived from x-request-id: a client may reuse one, and a stored response must not be overwritten.
        response_id = new_id("resp")
        if chain_root is None and req.store and not conversation_id:
            chain_root = response_id  # a stored response may start a chain: route it as its followers
        if ctx.routing_key is None:
            # previous_response_id changes every turn; the chain's root does not, so the whole chain
            # stays on one worker's KV cache (consistent_hash).
            ctx.routing_key = chain_root or conversation_id or req.user
        envelope = response_envelope(req, response_id, int(time.time()), group.name, effort, mapped.sampling)
        plan = ResponsePlan(
            request=req,
            response_id=response_id,
            owner=ctx.owner,
            prepared=prepared,
            input_items=items,
            references=references,
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
            compact_threshold=threshold,
        )
        if render and not approvals:
            await render_turn(state, plan)  # early: a prompt over the context is a 400, not a stream
        return plan
    except BaseException:
        if loop is not None:
            await loop.aclose()
        raise


async def fit_history(
    state: GatewayState, prepared: PreparedRequest, history: list[Msg], turn: list[Msg], *, truncate: bool
) -> list[Msg]:
    """The newest messages of `history` that fit the model's context with this turn: all of them when
    they fit, else (`truncation: "auto"`) the newest that do. Raises InvalidRequest
    `context_length_exceeded` when they do not fit and truncation is disabled. Counting stops at the
    first message that does not fit, so an oversized history is never tokenized whole."""
    context_tokens = prepared.group.info.max_context_length
    if not context_tokens or not history:
        return history
    assert prepared.prefix is not None
    on_loop = renders_on_loop(state.renderer, prepared.prefix, [*history, *turn])
    kept = await newest_that_fit(
        state.renderer, prepared.prefix, history, turn, context_tokens, on_loop=on_loop
    )
    if kept == len(history):
        return history
    if not truncate:
        raise history_too_long(context_tokens)
    return history[len(history) - kept :]


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
    prepared = await render_prompt(
        state, plan.prepared, plan.messages(), remaining_budget(plan), param="input"
    )
    prepared.max_reasoning_tokens = remaining_reasoning(plan)
    plan.prepared = prepared


def remaining_reasoning(plan: ResponsePlan) -> int | None:
    """`reasoning.max_tokens` left for the next iteration: like `max_output_tokens`, the budget covers
    the whole tool loop. Once spent, later iterations may reason one token before they must answer."""
    reasoning = plan.request.reasoning
    limit = reasoning.max_tokens if reasoning is not None else None
    return None if limit is None else max(limit - plan.reasoning_tokens, 1)


def parse_into(builder: ResponseBuilder, parser: tp.HarmonyOutputParser, chunk: EngineChunk) -> None:
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
