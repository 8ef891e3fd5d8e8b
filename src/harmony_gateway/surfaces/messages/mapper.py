"""Anthropic Messages API: a Messages request becomes the same conversation as a chat request, and the
chat-level deltas of `ChoiceOutput` (Harmony) or `TextChoiceOutput` (other models, HTTP upstreams) become
Anthropic content blocks and stream events.

Other models take the chat-template path (`messages_as_chat` → `chat_template.prepare_chat_template`):
`system` → a system message, `thinking` blocks → `reasoning_content`, `tool_use` → `tool_calls` (arguments
the JSON of `input`), `tool_result` → a `tool` message; the configured reasoning / tool-call parsers give
`thinking` and `tool_use` blocks back. `thinking.budget_tokens` only chooses whether thinking blocks are
shown (no budget is enforced for these models). Models served by an HTTP upstream go the chat path to the
upstream: Harmony ones as a rendered prompt parsed by the text-level parser (any thinking budget is not
enforced: it needs a gRPC engine), other ones as a forwarded chat request.

Request mapping (REFERENCE §2, with Anthropic's names):

| Anthropic | Harmony |
|---|---|
| `system` (string or text blocks), leading `role:"system"` messages | developer instructions |
| later `role:"system"` messages (mid-conversation beta) | a developer message in place |
| user `text` blocks | one user message (blocks joined with a newline) |
| user `tool_result` | tool message authored `functions.NAME` (NAME from the matching `tool_use` id) |
| assistant `thinking` | analysis message; `redacted_thinking` is skipped |
| assistant `text` | final message, or a commentary preamble when the turn also calls tools |
| assistant `tool_use` | commentary call `to=functions.NAME`, `<|constrain|>json`, compact JSON of `input` |
| `tools[]` (`name`, `description`, `input_schema`) | function tools; server tools (a versioned `type`) are 400 |
| `tool_choice` auto / any / tool / none | auto / required / the named function / tools hidden |

Reasoning effort: `output_config.effort` when given; else `thinking.budget_tokens` below 4096 → low, below
16384 → medium, else high (Claude Code's "think" / "think hard" / "ultrathink" budgets land on the three
levels); else `adaptive` → medium; thinking disabled or absent → low. `budget_tokens` is also the reasoning
budget (pipeline/reasoning_budget.py). Thinking blocks are returned only when thinking is enabled or
adaptive: clients that did not ask for thinking often read `content[0].text`.

Reasoning across tool turns: an assistant turn with `tool_use` blocks sent back without its `thinking`
gets the analysis the gateway produced for it restored, found by the tool_use ids it issued
(`reasoning_store`); thinking blocks the client sends always win.

Thinking blocks sent back: a `signature` this gateway made (`reasoning_store.SIGNATURE_PREFIX`) must
verify for the request's tenant and the block's text, else 400 naming it (a changed block, or one issued
to another API key); a block with any other signature is the client's own thinking and is rendered.

Output: analysis → `thinking` blocks (with a `signature`: HMAC-SHA256 of the tenant and the text under
the gateway's reasoning key, `ReasoningVault.sign`), final and preamble text → `text` blocks, function
calls → `tool_use` blocks (`toolu_...`, `input` parsed from the arguments; arguments that are not a JSON
object give `input: {}` and a warning in the log). A call's arguments are streamed as one
`input_json_delta` when the call is complete, because the SDK parses every partial JSON prefix and would
fail on invalid arguments.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidRequest, ModelNotFound
from ...harmony import token_parser as tp
from ...harmony.messages import (
    FunctionTool,
    Msg,
    dedupe_function_tools,
    parse_reasoning_effort,
    tool_result,
    user,
)
from ...observability.tracing import traced
from ...pipeline.context import GatewayState, PreparedRequest
from ...pipeline.hosted_tools import note_dropped_tool
from ...pipeline.prepare import (
    HarmonyTurn,
    apply_tool_choice,
    prepare_harmony,
    sampling_options,
    stop_strings,
)
from ...pipeline.reasoning_store import (
    SIGNATURE_PREFIX,
    AssistantTurn,
    reasoning_vault,
    recall_analyses,
    restorable_turns,
    turn_remembering,
)
from ...routing.fleet import ModelGroup
from ..chat.template import prepare_chat_template
from ..chat.types import ChatCompletionRequest
from ..chat.upstream import attach_harmony_upstream, is_text_group
from ..harmony_history import HarmonyHistory
from .framer import thinking_signature
from .types import CountTokensRequest, MessagesRequest

#: `thinking.budget_tokens` below the first bound → low, below the second → medium, else high.
EFFORT_BOUNDS = (4096, 16384)
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"


# -- model lookup ---------------------------------------------------------------------------------
def resolve_group(state: GatewayState, model: str) -> ModelGroup:
    """The model group for a Messages request.

    Order: `--model-alias NAME=MODEL`; a served model of that name; then, for a `claude-*` name, the only
    served model when exactly one is served (Claude Code asks for its small/fast `claude-*` model in
    background requests such as titles and command checks)."""
    aliases = state.settings.model_aliases
    target = aliases.get(model, model)
    try:
        return state.fleet.group(target)
    except ModelNotFound:
        groups = list(state.fleet.groups.values())
        if model.startswith("claude-") and len(groups) == 1:
            return groups[0]
        raise


# -- request → Harmony -----------------------------------------------------------------------------
def effort_for_budget(budget_tokens: int) -> str:
    low, medium = EFFORT_BOUNDS
    if budget_tokens < low:
        return "low"
    return "medium" if budget_tokens < medium else "high"


def thinking_options(request: CountTokensRequest) -> tuple[str, bool, int | None]:
    """(reasoning effort, whether thinking blocks are returned, reasoning budget)."""
    thinking = request.thinking
    kind = thinking.type if thinking is not None else "disabled"
    budget = thinking.budget_tokens if thinking is not None and kind == "enabled" else None
    if kind == "enabled" and budget is None:
        raise InvalidRequest("thinking.budget_tokens is required when thinking is enabled", param="thinking")
    effort_text = request.output_config.effort if request.output_config is not None else None
    if effort_text:
        effort = parse_reasoning_effort(effort_text, param="output_config.effort")
    elif budget is not None:
        effort = effort_for_budget(budget)
    else:
        effort = "medium" if kind == "adaptive" else "low"
    return effort, kind != "disabled", budget


def _text_blocks(content: str | list[dict[str, Any]] | None, *, param: str) -> str:
    """Text of a string or a list of text blocks; any other block is 400 (gpt-oss reads text only)."""
    if not isinstance(content, list):
        return content or ""
    pieces = []
    for j, block in enumerate(content):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise InvalidRequest(
                f"content block type {block.get('type')!r} is not supported here: expected text blocks",
                param=f"{param}[{j}]",
            )
        pieces.append(block["text"])
    return _join(pieces)


def _join(pieces: Sequence[str]) -> str:
    """Join text blocks, with a newline between two blocks unless the first already ends with one."""
    out = ""
    for piece in pieces:
        if out and not out.endswith("\n"):
            out += "\n"
        out += piece
    return out


def _tool_result_text(content: Any, *, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("tool_result content must be a string or a list of blocks", param=param)
    pieces = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            pieces.append(block["text"])
        elif kind == "image":
            # Agents read image files through tools; failing the request would end their session.
            pieces.append(_IMAGE_PLACEHOLDER)
        else:
            raise InvalidRequest(f"tool_result block type {kind!r} is not supported", param=f"{param}[{j}]")
    return _join(pieces)


def _arguments_json(value: Any) -> str:
    # Compact, as gpt-oss writes arguments: the re-rendered history then matches the generated tokens.
    return json.dumps(value if value is not None else {}, ensure_ascii=False, separators=(",", ":"))


def anthropic_history(
    request: CountTokensRequest, restored: dict[int, str] | None = None
) -> tuple[str | None, list[Msg]]:
    """Messages → (instructions, Harmony history), after the analysis drop rule (REFERENCE §2.5).
    `restored` maps an assistant message's index to the analysis to render when it has no thinking of
    its own (`restorable_turns`)."""
    tool_names: dict[str, str] = {}
    for message in request.messages:
        if message.role == "assistant" and isinstance(message.content, list):
            for block in message.content:
                if block.get("type") == "tool_use" and isinstance(block.get("id"), str):
                    tool_names[block["id"]] = str(block.get("name") or "")

    system = _text_blocks(request.system, param="system")
    history = HarmonyHistory([system] if system else [])
    for i, message in enumerate(request.messages):
        param = f"messages[{i}].content"
        if message.role == "system":
            history.system(_text_blocks(message.content, param=param))
        elif message.role == "user":
            history.add(*_user_messages(message.content, tool_names, param=param))
        else:
            _assistant_message(message.content, history, param=param, restored=(restored or {}).get(i))
    return history.result()


def assistant_turns(request: CountTokensRequest) -> Iterator[AssistantTurn]:
    """The assistant messages of a Messages history, as reasoning restore reads them: the call ids are
    the ones the gateway issued (`toolu_X` was `call_X`)."""
    for i, message in enumerate(request.messages):
        if message.role != "assistant":
            continue
        blocks = message.content if isinstance(message.content, list) else []
        uses = [b["id"] for b in blocks if b.get("type") == "tool_use" and isinstance(b.get("id"), str)]
        yield AssistantTurn(
            index=i,
            call_ids=["call_" + u[6:] if u.startswith("toolu_") else u for u in uses],
            answers=bool(message.content)
            if isinstance(message.content, str)
            else any(b.get("text") for b in blocks),
            has_reasoning=any(b.get("type") in ("thinking", "redacted_thinking") for b in blocks),
        )


def _gateway_signed_thinking(request: CountTokensRequest) -> list[tuple[str, Any, str]]:
    """(param, thinking, signature) of each assistant `thinking` block whose signature is one this
    gateway makes (`ReasoningVault.sign`), which must verify before the block is rendered."""
    signed: list[tuple[str, Any, str]] = []
    for i, message in enumerate(request.messages):
        if message.role != "assistant" or not isinstance(message.content, list):
            continue
        for j, block in enumerate(message.content):
            signature = block.get("signature")
            if block.get("type") == "thinking" and isinstance(signature, str):
                if signature.startswith(SIGNATURE_PREFIX):
                    signed.append((f"messages[{i}].content[{j}].signature", block.get("thinking"), signature))
    return signed


async def _verify_thinking_signatures(state: GatewayState, request: CountTokensRequest, owner: str) -> None:
    """Raises InvalidRequest naming the first gateway-signed thinking block that was not signed for tenant
    `owner` over its text."""
    signed = _gateway_signed_thinking(request)
    if not signed:
        return
    vault = await reasoning_vault(state, owner)
    for param, text, signature in signed:
        if not (isinstance(text, str) and vault.verify(text, signature)):
            raise InvalidRequest(
                "thinking block signature does not match: the block was changed, or issued to another "
                "API key; send thinking blocks back unmodified, with the key that received them",
                param=param,
            )


#: A user turn's `tool_result` block as sent, with its param (`messages[i].content[j]`).
_ToolResult = tuple[dict[str, Any], str]


def _user_blocks(content: str | list[dict[str, Any]], *, param: str) -> Iterator[str | _ToolResult]:
    """A user turn in order: each run of text blocks as one text (joined), each `tool_result` block as
    itself; image and document blocks are 400 (this model reads text only). Lazy, so a caller's check
    of a tool result fails before any later block is read."""
    if isinstance(content, str):
        yield content
        return
    texts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if texts:
                yield _join(texts)
                texts = []
            yield block, f"{param}[{j}]"
        elif kind in ("image", "document"):
            raise InvalidRequest(
                f"content block type {kind!r} is not supported: this model accepts text only",
                param=f"{param}[{j}]",
            )
        else:
            raise InvalidRequest(f"unsupported user content block type {kind!r}", param=f"{param}[{j}]")
    if texts:
        yield _join(texts)


def _user_messages(
    content: str | list[dict[str, Any]], tool_names: dict[str, str], *, param: str
) -> Iterator[Msg]:
    for part in _user_blocks(content, param=param):
        if isinstance(part, str):
            yield user(part)
            continue
        block, where = part
        call_id = block.get("tool_use_id")
        name = tool_names.get(call_id) if isinstance(call_id, str) else None
        if not name:
            raise InvalidRequest(
                "tool_result refers to a tool_use id that no assistant message contains",
                param=f"{where}.tool_use_id",
            )
        text = _tool_result_text(block.get("content"), param=f"{where}.content")
        yield tool_result("functions." + name, text)


def _assistant_blocks(
    content: list[dict[str, Any]], *, param: str
) -> tuple[list[str], list[str], list[tuple[str | None, str, str]]]:
    """An assistant turn's blocks as (thinking texts, answer texts, tool uses as (id, name, arguments
    JSON)), in order; raises InvalidRequest naming the block."""
    thinking: list[str] = []
    texts: list[str] = []
    calls: list[tuple[str | None, str, str]] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "thinking":
            if block.get("thinking"):
                thinking.append(str(block["thinking"]))
        elif kind == "redacted_thinking":
            continue
        elif kind == "text" and isinstance(block.get("text"), str):
            if block["text"]:
                texts.append(block["text"])
        elif kind == "tool_use":
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest("tool_use blocks need a name", param=f"{param}[{j}].name")
            call_id = block.get("id") if isinstance(block.get("id"), str) else None
            calls.append((call_id, name, _arguments_json(block.get("input"))))
        else:
            raise InvalidRequest(f"unsupported assistant content block type {kind!r}", param=f"{param}[{j}]")
    return thinking, texts, calls


def _assistant_message(
    content: str | list[dict[str, Any]], history: HarmonyHistory, *, param: str, restored: str | None = None
) -> None:
    if isinstance(content, str):
        history.assistant_turn((), content, ())
        return
    thinking, texts, calls = _assistant_blocks(content, param=param)
    if not thinking and calls and restored:
        thinking = [restored]
    history.assistant_turn(thinking, _join(texts), [(name, arguments) for _, name, arguments in calls])


def anthropic_tools(
    request: CountTokensRequest, *, unbacked: str = "reject", metrics: Any = None
) -> list[FunctionTool]:
    """Function tools of the request. Server tools (a versioned `type`) have no backing here: with
    `unbacked="drop"` (`--unbacked-tools`) they are left out, logged once and counted, else 400."""
    tools: list[FunctionTool] = []
    for i, tool in enumerate(request.tools or []):
        if tool.type not in (None, "custom") and unbacked == "drop":
            note_dropped_tool(tool.type, metrics)
            continue
        if tool.type not in (None, "custom"):
            raise InvalidRequest(
                f"tool type {tool.type!r} is an Anthropic server tool, which this gateway cannot run; "
                "declare a custom tool with input_schema",
                param=f"tools[{i}].type",
            )
        tools.append(FunctionTool(tool.name, tool.description or "", tool.input_schema, f"tools[{i}]"))
    tools = dedupe_function_tools(tools)
    choice = request.tool_choice
    if choice is None:
        return tools
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice of type 'tool' needs a name", param="tool_choice.name")
        return apply_tool_choice(tools, {"type": "function", "name": choice.name}, param="tool_choice")
    return apply_tool_choice(tools, _TOOL_CHOICES[choice.type], param="tool_choice")


def stop_sequences(values: list[str] | None) -> tuple[str, ...]:
    return stop_strings(values, param="stop_sequences")


def _chat_user(content: str | list[dict[str, Any]], out: list[dict[str, Any]], *, param: str) -> None:
    for part in _user_blocks(content, param=param):
        if isinstance(part, str):
            out.append({"role": "user", "content": part})
            continue
        block, where = part
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequest("tool_result blocks need a tool_use_id", param=f"{where}.tool_use_id")
        text = _tool_result_text(block.get("content"), param=f"{where}.content")
        out.append({"role": "tool", "tool_call_id": call_id, "content": text})


def _chat_assistant(content: str | list[dict[str, Any]], *, param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    thinking, texts, calls = _assistant_blocks(content, param=param)
    message: dict[str, Any] = {"role": "assistant", "content": _join(texts)}
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    if calls:
        message["tool_calls"] = [
            {
                "id": call_id or tp.new_call_id(),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for call_id, name, arguments in calls
        ]
    return message


def messages_as_chat(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request stands for (module docstring); raises InvalidRequest naming
    the Messages field."""
    messages: list[dict[str, Any]] = []
    system = _text_blocks(request.system, param="system")
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        param = f"messages[{i}].content"
        if message.role == "system":
            text = _text_blocks(message.content, param=param)
            if text:
                messages.append({"role": "system", "content": text})
        elif message.role == "user":
            _chat_user(message.content, messages, param=param)
        else:
            messages.append(_chat_assistant(message.content, param=param))
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    tools = anthropic_tools(request)  # tool_choice already applied: the chosen tools are rendered
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters or {"type": "object", "properties": {}},
                },
            }
            for t in tools
        ]
    if isinstance(request, MessagesRequest):
        body["max_tokens"] = request.max_tokens
        body["stream"] = request.stream
        sampling = {"temperature": request.temperature, "top_p": request.top_p, "top_k": request.top_k}
        body.update((key, value) for key, value in sampling.items() if value is not None)
        if request.stop_sequences:
            body["stop"] = list(stop_sequences(request.stop_sequences))
    return ChatCompletionRequest.model_validate(body)


@dataclass(slots=True)
class MessagesPlan:
    prepared: PreparedRequest
    show_thinking: bool
    #: Signs a thinking block's text (`ReasoningVault.sign`).
    sign: Callable[[str], str] = field(default=lambda text: thinking_signature(text))


def messages_turn(
    request: CountTokensRequest, group: ModelGroup, tools: list[FunctionTool], restored: dict[int, str]
) -> HarmonyTurn:
    """Messages (or count_tokens) → one Harmony turn; `tools` are the request's (`anthropic_tools`),
    `restored` the analyses recalled for earlier tool-use turns."""
    effort, _, budget = thinking_options(request)
    instructions, history = anthropic_history(request, restored)
    full = request if isinstance(request, MessagesRequest) else None
    return HarmonyTurn(
        effort=effort,
        instructions=instructions,
        history=history,
        sampling=sampling_options(
            group,
            temperature=full.temperature if full else None,
            top_p=full.top_p if full else None,
            top_k=full.top_k if full else None,
        ),
        tools=tuple(tools),
        forces_call=request.tool_choice is not None and request.tool_choice.type in ("any", "tool"),
        max_tokens=full.max_tokens if full else None,
        stop_strings=stop_sequences(full.stop_sequences if full else None),
        stream=bool(full and full.stream),
        max_reasoning_tokens=budget,
    )


@traced("gateway.prepare")
async def prepare_messages(
    state: GatewayState, request: CountTokensRequest, group: ModelGroup, *, owner: str
) -> MessagesPlan:
    """Validate and render a Messages (or count_tokens) request for tenant `owner` (`ctx.owner`), whose
    analyses of earlier tool-use turns are restored; raises InvalidRequest naming the field."""
    _, show_thinking, _ = thinking_options(request)
    await _verify_thinking_signatures(state, request, owner)
    if not group.harmony:
        return MessagesPlan(
            await prepare_chat_template(state, messages_as_chat(request), group), show_thinking
        )
    tools = anthropic_tools(request, unbacked=state.settings.unbacked_tools, metrics=state.metrics)
    restored = await recall_analyses(state, owner, restorable_turns(assistant_turns(request)))
    full = request if isinstance(request, MessagesRequest) else None
    prepared = await prepare_harmony(state, group, messages_turn(request, group, tools, restored))
    if full is not None:
        prepared.after_turn = turn_remembering(state, owner)
    if full is not None and is_text_group(group):
        # An HTTP upstream: Harmony as text, read back by the text-level parser. A thinking budget
        # needs a gRPC engine; Claude Code always sends one, so it is dropped rather than refused.
        prepared.max_reasoning_tokens = None
        attach_harmony_upstream(state, prepared, messages_as_chat(full))
    shown = full is not None and show_thinking
    sign = (await reasoning_vault(state, owner)).sign if shown else thinking_signature
    return MessagesPlan(prepared, show_thinking, sign)


# -- output: deltas → content blocks -----------------------------------------------------------------
