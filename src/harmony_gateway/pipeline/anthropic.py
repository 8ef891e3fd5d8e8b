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

import base64
import hashlib
import json
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..engines.base import EngineChunk
from ..errors import InvalidRequest, ModelNotFound
from ..harmony import token_parser as tp
from ..harmony.messages import (
    FunctionTool,
    Msg,
    assistant,
    assistant_call,
    dedupe_function_tools,
    developer_text,
    drop_old_analysis,
    parse_reasoning_effort,
    tool_result,
    user,
)
from ..observability.tracing import traced
from ..routing.fleet import ModelGroup
from ..types.anthropic import CountTokensRequest, MessagesRequest
from ..types.chat import ChatCompletionRequest
from .context import GatewayState, PreparedRequest, RequestContext
from .drive import collect, drive, open_generation
from .hosted_tools import note_dropped_tool
from .parse_output import CONTENT, REASONING_TEXT, TOOL_ARGS, TOOL_OPEN, ChoiceOutput
from .prepare import HarmonyTurn, apply_tool_choice, prepare_harmony, sampling_options
from .reasoning_budget import budget_exceeded
from .reasoning_store import SIGNATURE_PREFIX, reasoning_vault, recall_analyses, turn_remembering
from .text_output import TextChoiceOutput, text_parser_stats
from .text_upstream import attach_harmony_upstream, is_text_group

log = logging.getLogger(__name__)

#: `thinking.budget_tokens` below the first bound → low, below the second → medium, else high.
EFFORT_BOUNDS = (4096, 16384)
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"
_dumps = orjson.dumps


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
    if content is None:
        return ""
    if isinstance(content, str):
        return content
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

    instructions: list[str] = []
    system = _text_blocks(request.system, param="system")
    if system:
        instructions.append(system)
    history: list[Msg] = []
    leading = True
    for i, message in enumerate(request.messages):
        param = f"messages[{i}].content"
        if message.role == "system":
            text = _text_blocks(message.content, param=param)
            if leading and text:
                instructions.append(text)
            elif text:
                history.append(developer_text(text))
            continue
        leading = False
        if message.role == "user":
            _user_message(message.content, tool_names, history, param=param)
        else:
            _assistant_message(message.content, history, param=param, restored=(restored or {}).get(i))
    return ("\n\n".join(instructions) or None), drop_old_analysis(history)


def restorable_turns(request: CountTokensRequest) -> dict[int, list[str]]:
    """Assistant turns with `tool_use` blocks and no thinking after the last final answer, by index, with
    the call ids the gateway issued for them (`toolu_X` was `call_X`)."""
    turns: dict[int, list[str]] = {}
    for i, message in enumerate(request.messages):
        if message.role != "assistant":
            continue
        blocks = message.content if isinstance(message.content, list) else []
        uses: list[str] = [
            b["id"] for b in blocks if b.get("type") == "tool_use" and isinstance(b.get("id"), str)
        ]
        if not uses:
            if message.content if isinstance(message.content, str) else any(b.get("text") for b in blocks):
                turns.clear()  # a final answer: the analysis before it is dropped
            continue
        if not any(b.get("type") in ("thinking", "redacted_thinking") for b in blocks):
            turns[i] = ["call_" + u[6:] if u.startswith("toolu_") else u for u in uses]
    return turns


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


def _user_message(
    content: str | list[dict[str, Any]], tool_names: dict[str, str], history: list[Msg], *, param: str
) -> None:
    if isinstance(content, str):
        history.append(user(content))
        return
    texts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if texts:
                history.append(user(_join(texts)))
                texts = []
            call_id = block.get("tool_use_id")
            name = tool_names.get(call_id) if isinstance(call_id, str) else None
            if not name:
                raise InvalidRequest(
                    "tool_result refers to a tool_use id that no assistant message contains",
                    param=f"{param}[{j}].tool_use_id",
                )
            text = _tool_result_text(block.get("content"), param=f"{param}[{j}].content")
            history.append(tool_result("functions." + name, text))
        elif kind in ("image", "document"):
            raise InvalidRequest(
                f"content block type {kind!r} is not supported: this model accepts text only",
                param=f"{param}[{j}]",
            )
        else:
            raise InvalidRequest(f"unsupported user content block type {kind!r}", param=f"{param}[{j}]")
    if texts:
        history.append(user(_join(texts)))


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
    content: str | list[dict[str, Any]], history: list[Msg], *, param: str, restored: str | None = None
) -> None:
    if isinstance(content, str):
        if content:
            history.append(assistant(content, "final"))
        return
    thinking, texts, calls = _assistant_blocks(content, param=param)
    if not thinking and calls and restored:
        thinking = [restored]
    # The order the model generates: analysis, preamble, calls (REFERENCE §2.3).
    history.extend(assistant(text, "analysis") for text in thinking)
    if texts:
        history.append(assistant(_join(texts), "commentary" if calls else "final"))
    history.extend(assistant_call("functions." + name, arguments) for _, name, arguments in calls)


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
    if not values:
        return ()
    if len(values) > 16:
        raise InvalidRequest("at most 16 stop sequences are supported", param="stop_sequences")
    if any(not value for value in values):
        raise InvalidRequest("stop sequences must be non-empty strings", param="stop_sequences")
    return tuple(values)


def _chat_user(content: str | list[dict[str, Any]], out: list[dict[str, Any]], *, param: str) -> None:
    if isinstance(content, str):
        out.append({"role": "user", "content": content})
        return
    texts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": _join(texts)})
                texts = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(
                    "tool_result blocks need a tool_use_id", param=f"{param}[{j}].tool_use_id"
                )
            text = _tool_result_text(block.get("content"), param=f"{param}[{j}].content")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind in ("image", "document"):
            raise InvalidRequest(
                f"content block type {kind!r} is not supported: this model accepts text only",
                param=f"{param}[{j}]",
            )
        else:
            raise InvalidRequest(f"unsupported user content block type {kind!r}", param=f"{param}[{j}]")
    if texts:
        out.append({"role": "user", "content": _join(texts)})


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
        from .chat_template import prepare_chat_template

        return MessagesPlan(
            await prepare_chat_template(state, messages_as_chat(request), group), show_thinking
        )
    tools = anthropic_tools(request, unbacked=state.settings.unbacked_tools, metrics=state.metrics)
    restored = await recall_analyses(state, owner, restorable_turns(request))
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
def thinking_signature(text: str) -> str:
    """An opaque signature the SDK accepts, for requests that never show thinking (count_tokens, other
    models); shown thinking is signed with the gateway key (`ReasoningVault.sign`)."""
    digest = hashlib.sha256(text.encode()).digest()[:24]
    return "hg1." + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or tp.new_call_id())[5:]


def parse_tool_input(arguments: str, name: str | None) -> tuple[dict[str, Any], bool]:
    """(input, valid): the arguments as a JSON object, or `{}` when they are not one."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value, True
    log.warning("tool call %s: arguments are not a JSON object; sent as input {}: %.200r", name, arguments)
    return {}, False


def _frame(event: str, payload: bytes) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + payload + b"\n\n"


_THINKING, _TEXT, _TOOL = "thinking", "text", "tool_use"


class MessageBlocks:
    """Builds content blocks from one choice's chat-level deltas; with `stream`, also the SSE events.

    A block opens on the first delta of its kind and closes when another kind starts: a thinking block
    closes with a `signature_delta`, a tool_use block with its whole arguments as one `input_json_delta`.
    """

    def __init__(self, *, stream: bool, sign: Callable[[str], str] = thinking_signature) -> None:
        self.sign = sign
        self.blocks: list[dict[str, Any]] = []
        self._stream = stream
        self._kind: str | None = None
        self._parts: list[str] = []
        self._tool: dict[str, Any] | None = None

    def push(self, deltas: list[tuple[Any, ...]]) -> bytes:
        out: list[bytes] = []
        pending_kind: str | None = None
        pending: list[str] = []
        for delta in deltas:
            kind = delta[0]
            if kind == CONTENT or kind == REASONING_TEXT:
                block = _TEXT if kind == CONTENT else _THINKING
                text = delta[1]
                if self._kind != block:
                    self._flush(pending_kind, pending, out)
                    pending_kind, pending = None, []
                    self._close(out)
                    if text.startswith("\n"):
                        text = text[1:]  # the separator between two messages that now sit in two blocks
                    if not text:
                        continue
                    self._open(block, out)
                pending_kind = block
                pending.append(text)
                self._parts.append(text)
            elif kind == TOOL_OPEN:
                self._flush(pending_kind, pending, out)
                pending_kind, pending = None, []
                self._close(out)
                self._tool = {"id": tool_use_id(delta[2]), "name": delta[3]}
                self._open(_TOOL, out)
            elif kind == TOOL_ARGS and self._kind == _TOOL:
                self._parts.append(delta[2])
        self._flush(pending_kind, pending, out)
        return b"".join(out)

    def close(self) -> bytes:
        out: list[bytes] = []
        self._close(out)
        return b"".join(out)

    def _open(self, kind: str, out: list[bytes]) -> None:
        self._kind = kind
        self._parts = []
        if not self._stream:
            return
        if kind == _THINKING:
            start: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == _TEXT:
            start = {"type": "text", "text": ""}
        else:
            start = {"type": "tool_use", **(self._tool or {}), "input": {}}
        payload = {"type": "content_block_start", "index": len(self.blocks), "content_block": start}
        out.append(_frame("content_block_start", _dumps(payload)))

    def _flush(self, kind: str | None, pieces: list[str], out: list[bytes]) -> None:
        if not self._stream or kind is None or not pieces:
            return
        text = pieces[0] if len(pieces) == 1 else "".join(pieces)
        field = b'"thinking_delta","thinking":' if kind == _THINKING else b'"text_delta","text":'
        out.append(
            _frame(
                "content_block_delta",
                b'{"type":"content_block_delta","index":%d,"delta":{"type":' % len(self.blocks)
                + field
                + _dumps(text)
                + b"}}",
            )
        )

    def _close(self, out: list[bytes]) -> None:
        kind = self._kind
        if kind is None:
            return
        index = len(self.blocks)
        text = "".join(self._parts)
        stream = self._stream
        if kind == _THINKING:
            signature = self.sign(text)
            self.blocks.append({"type": "thinking", "thinking": text, "signature": signature})
            if stream:
                delta = {"type": "signature_delta", "signature": signature}
                payload = {"type": "content_block_delta", "index": index, "delta": delta}
                out.append(_frame("content_block_delta", _dumps(payload)))
        elif kind == _TEXT:
            self.blocks.append({"type": "text", "text": text})
        else:
            tool = self._tool or {}
            value, valid = parse_tool_input(text, tool.get("name"))
            self.blocks.append({"type": "tool_use", **tool, "input": value})
            if stream:
                partial = text if valid and text.strip() else _dumps(value).decode()
                delta = {"type": "input_json_delta", "partial_json": partial}
                payload = {"type": "content_block_delta", "index": index, "delta": delta}
                out.append(_frame("content_block_delta", _dumps(payload)))
            self._tool = None
        if stream:
            out.append(_frame("content_block_stop", b'{"type":"content_block_stop","index":%d}' % index))
        self._kind = None
        self._parts = []


def matched_stop_sequence(choice: ChoiceOutput | TextChoiceOutput, stops: tuple[str, ...]) -> str | None:
    """The client stop sequence that ended the answer: the earliest in the answer text."""
    if isinstance(choice, TextChoiceOutput):
        text = "".join(choice.answer_seen)
    else:
        text = "".join(m.text for m in choice.parser.messages if m.kind in (tp.ANSWER, tp.PREAMBLE))
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best[1] if best else None


def stop_reason(choice: ChoiceOutput | TextChoiceOutput, stops: tuple[str, ...]) -> tuple[str, str | None]:
    if choice.stop_hit:
        return "stop_sequence", matched_stop_sequence(choice, stops)
    if choice.engine_finish == "length":
        return "max_tokens", None
    if choice.tool_calls:
        return "tool_use", None
    return "end_turn", None


def anthropic_usage(
    choice: ChoiceOutput | TextChoiceOutput, prepared: PreparedRequest, ctx: RequestContext
) -> dict[str, Any]:
    """`input_tokens` excludes cache reads, as Anthropic counts: total input = input + cache read + creation."""
    prompt = choice.prompt_tokens or len(prepared.input_ids)
    cached = min(choice.cached_tokens, prompt)
    details: dict[str, Any] = {"thinking_tokens": choice.parser.reasoning_tokens}
    if prepared.max_reasoning_tokens is not None:
        details["reasoning_budget_exceeded"] = budget_exceeded(ctx)
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": choice.completion_tokens or choice.parser.output_tokens,
        "output_tokens_details": details,
    }


# -- running a request -----------------------------------------------------------------------------
async def count_message_tokens(
    state: GatewayState, request: CountTokensRequest, *, owner: str
) -> dict[str, int]:
    group = resolve_group(state, request.model)
    if not group.harmony and is_text_group(group):
        raise InvalidRequest(
            f"POST /v1/messages/count_tokens is not available for model {group.name!r}: it is served by an "
            "HTTP upstream, whose chat template the gateway does not render",
            param="model",
        )
    plan = await prepare_messages(state, request, group, owner=owner)
    return {"input_tokens": len(plan.prepared.input_ids)}


async def run_messages(
    state: GatewayState, request: MessagesRequest, ctx: RequestContext
) -> dict[str, Any] | AsyncGenerator[bytes, None]:
    """A Message body, or the SSE byte stream; raises GatewayError before any output."""
    group = resolve_group(state, request.model)
    ctx.model = group.name
    plan = await prepare_messages(state, request, group, owner=ctx.owner)
    prepared = plan.prepared
    ctx.prompt_tokens = len(prepared.input_ids)
    choice: ChoiceOutput | TextChoiceOutput
    if prepared.output_adapter is not None:  # other models, HTTP upstreams: text output
        choice = TextChoiceOutput(state, prepared, 0)
        ctx.text_stats = text_parser_stats([choice])
    else:
        choice = ChoiceOutput(state, prepared, 0)
        ctx.parsers = [choice.parser]
    choice.include_reasoning = plan.show_thinking
    # Streaming from the engine lets the gateway stop early on a client stop sequence.
    engine_stream = request.stream or bool(prepared.stop_strings)
    source = await open_generation(state, prepared, ctx, stream=engine_stream)
    message_id = "msg_" + ctx.request_id
    framer = MessagesFramer(
        message_id, group.name, prepared, ctx, choice, stream=request.stream, sign=plan.sign
    )
    if request.stream:
        return drive(ctx, source, framer)
    await collect(ctx, source, framer)
    blocks = framer.blocks
    blocks.push(choice.close())
    blocks.close()
    if prepared.after_turn is not None:
        await prepared.after_turn(choice)  # hook: restorable analysis of tool-call turns
    reason, sequence = stop_reason(choice, prepared.stop_strings)
    usage = anthropic_usage(choice, prepared, ctx)
    ctx.completion_tokens = usage["output_tokens"]
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": group.name,
        "content": blocks.blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }


class MessagesFramer:
    """Anthropic's event protocol: `message_start` (with the first chunk's prompt counts) and `ping`,
    content block events per engine chunk, then `message_delta` and `message_stop`; a failure is the
    `error` event. Not streaming, it only collects the blocks. A stop sequence ends it early."""

    __slots__ = ("_choice", "_ctx", "_head_due", "_message_id", "_model", "_prepared", "blocks", "unsettled")

    def __init__(
        self,
        message_id: str,
        model: str,
        prepared: PreparedRequest,
        ctx: RequestContext,
        choice: ChoiceOutput | TextChoiceOutput,
        *,
        stream: bool,
        sign: Callable[[str], str] = thinking_signature,
    ) -> None:
        self._message_id = message_id
        self._model = model
        self._prepared = prepared
        self._ctx = ctx
        self._choice = choice
        self._head_due = stream
        self.blocks = MessageBlocks(stream=stream, sign=sign)
        self.unsettled = False

    def _head(self, first: EngineChunk | None) -> bytes:
        self._head_due = False
        prompt = (first.prompt_tokens if first is not None else 0) or len(self._prepared.input_ids)
        cached = min(first.cached_tokens if first is not None else 0, prompt)
        start = {
            "type": "message_start",
            "message": {
                "id": self._message_id,
                "type": "message",
                "role": "assistant",
                "model": self._model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": prompt - cached,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": cached,
                    "output_tokens": 0,
                },
            },
        }
        return _frame("message_start", _dumps(start)) + _frame("ping", b'{"type":"ping"}')

    def feed(self, chunk: EngineChunk) -> bytes:
        head = self._head(chunk) if self._head_due else b""
        return head + self.blocks.push(self._choice.feed(chunk))

    def stopped(self) -> bool:
        return self._choice.stop_hit

    async def settle(self) -> None:
        """The turn's after-turn work (restorable analysis), before its closing events go out."""
        self.unsettled = False
        if self._prepared.after_turn is not None:
            await self._prepared.after_turn(self._choice)

    def tail(self) -> bytes:
        choice = self._choice
        tail = self._head(None) if self._head_due else b""
        tail += self.blocks.push(choice.close()) + self.blocks.close()
        self.unsettled = self._prepared.after_turn is not None
        reason, sequence = stop_reason(choice, self._prepared.stop_strings)
        usage = anthropic_usage(choice, self._prepared, self._ctx)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage,
        }
        return (
            tail + _frame("message_delta", _dumps(delta)) + _frame("message_stop", b'{"type":"message_stop"}')
        )

    def error(self, exc: BaseException) -> bytes:
        return self._ctx.error_frame(exc)

    def completion_tokens(self) -> int:
        choice = self._choice
        return choice.completion_tokens or choice.parser.output_tokens


__all__ = [
    "EFFORT_BOUNDS",
    "MessageBlocks",
    "anthropic_history",
    "count_message_tokens",
    "effort_for_budget",
    "messages_as_chat",
    "prepare_messages",
    "resolve_group",
    "run_messages",
    "thinking_options",
]
