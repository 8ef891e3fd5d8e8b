"""Stage 1, prepare: validate a request and turn it into prompt ids, sampling and a selection text.

Harmony models get a Harmony conversation (system: effort and date; developer: instructions and tools;
then the history) rendered by `PromptRenderer`; other models are handled by `surfaces/chat/template.py`.
Raises `InvalidRequest` naming the offending field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import time
import weakref
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from ..engines.base import SamplingOptions
from ..errors import InvalidRequest
from ..harmony.encoding import ASSISTANT_STOP_IDS, PromptRenderer, assistant_header
from ..harmony.messages import (
    FunctionTool,
    Msg,
    PromptPrefix,
    ResponseFormat,
    SystemOptions,
    ToolNamespace,
)
from ..routing.fleet import ModelGroup
from ..types.limits import MAX_SCHEMA_CHARS, schema_too_large
from ..types.tool_names import is_tool_name
from .context import GatewayState, PreparedRequest
from .offload import map_off_loop

SELECTION_TEXT_CHARS = 2000


def conversation_date(state: GatewayState, started: str | None = None) -> str:
    """The system message's date: the setting that pins it, else the date a Responses chain or conversation
    started (`started`, so its prompt prefix stays byte-identical across midnight and keeps hitting the
    engines' prefix caches), else today's UTC date."""
    return state.settings.conversation_start_date or started or utc_date(time.time())


_SECONDS_PER_DAY = 86400
#: The last day formatted, as (days since the epoch, "YYYY-MM-DD"): one strftime a day, not a request.
_last_day: tuple[int, str] = (-1, "")


def utc_date(timestamp: float) -> str:
    global _last_day
    day = int(timestamp // _SECONDS_PER_DAY)
    if day != _last_day[0]:
        _last_day = (day, dt.datetime.fromtimestamp(timestamp, dt.UTC).strftime("%Y-%m-%d"))
    return _last_day[1]


def system_options(
    state: GatewayState,
    effort: str,
    *,
    browser: bool = False,
    python: bool = False,
    started: str | None = None,
) -> SystemOptions:
    s = state.settings
    return SystemOptions(
        effort=effort,
        conversation_start_date=conversation_date(state, started),
        model_identity=s.model_identity,
        knowledge_cutoff=s.knowledge_cutoff,
        browser_tool=browser,
        python_tool=python,
    )


def apply_tool_choice(
    tools: list[FunctionTool], tool_choice: str | dict[str, Any] | None, *, param: str = "tool_choice"
) -> list[FunctionTool]:
    """`none` hides the tools from the model (peers render them and the model calls anyway); a named
    choice keeps only that tool."""
    if tool_choice is None or tool_choice == "auto":
        return tools
    if tool_choice == "none":
        return []
    if tool_choice == "required":
        if not tools:
            raise InvalidRequest("tool_choice 'required' needs at least one tool", param=param)
        return tools
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") or {}
        name = fn.get("name") if isinstance(fn, dict) else None
        name = name or tool_choice.get("name")
        if tool_choice.get("type") == "function" and isinstance(name, str):
            chosen = [t for t in tools if t.name == name]
            if not chosen:
                raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools", param=param)
            return chosen
        if tool_choice.get("type") == "allowed_tools":
            allowed = allowed_tool_names(tool_choice, param=param)
            return [t for t in tools if t.name in allowed]
    raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or a named function", param=param)


def allowed_tool_names(tool_choice: dict[str, Any], *, param: str) -> set[str]:
    """The function names an `allowed_tools` choice lists. Chat nests the list (`{"type": "allowed_tools",
    "allowed_tools": {"mode", "tools"}}`), the Responses API does not (`{"type", "mode", "tools"}`); an
    entry without a name (a hosted tool) names no function. Raises InvalidRequest naming a malformed part."""
    nested = "allowed_tools" in tool_choice
    spec = tool_choice["allowed_tools"] if nested else tool_choice
    where = f"{param}.allowed_tools" if nested else param
    if not isinstance(spec, dict):
        raise InvalidRequest("allowed_tools must be an object with a list of tools", param=where)
    listed = spec.get("tools", [])
    if not isinstance(listed, list):
        raise InvalidRequest("allowed_tools.tools must be a list of tools", param=f"{where}.tools")
    names: set[str] = set()
    for i, entry in enumerate(listed):
        if not isinstance(entry, dict):
            raise InvalidRequest("allowed tools must be objects", param=f"{where}.tools[{i}]")
        function = entry.get("function")
        holder, key = (function, "function.name") if isinstance(function, dict) else (entry, "name")
        name = holder.get("name")
        if name is None:
            continue
        if not isinstance(name, str):
            raise InvalidRequest("allowed tool names must be strings", param=f"{where}.tools[{i}].{key}")
        names.add(name)
    return names


def forces_tool_call(tool_choice: str | dict[str, Any] | None) -> bool:
    """`required`, a named function or an allowed-tools choice: the engine constrains the call."""
    if tool_choice == "required":
        return True
    return isinstance(tool_choice, dict) and tool_choice.get("type") in ("function", "allowed_tools")


def output_constraint(
    call_tools: Sequence[FunctionTool] = (), response_format: ResponseFormat | None = None
) -> str | None:
    """An SGLang/vLLM `structural_tag` over the parts of the output that must follow a schema, and
    nothing else (REFERENCE §2.8): once the model opens a commentary call, the header must name one of
    `call_tools` and the arguments match its schema; once it opens the final channel, the answer must
    match `response_format`. Analysis stays free; constraining the whole output would block the control
    tokens (ollama#11691). A tool name goes into the tag verbatim, so only a valid one is accepted
    (request types check declared names; this keeps names from anywhere else out of the grammar)."""
    structures: list[dict[str, Any]] = []
    triggers: list[str] = []
    for tool in call_tools:
        if not is_tool_name(tool.name):
            raise InvalidRequest(
                f"tool name {tool.name[:80]!r} cannot be constrained", param=f"{tool.param or 'tools'}.name"
            )
    if call_tools:
        structures.extend(
            {
                "begin": f"<|channel|>commentary to=functions.{tool.name} <|constrain|>json<|message|>",
                "schema": tool.parameters or {"type": "object"},
                "end": "<|call|>",
            }
            for tool in call_tools
        )
        triggers.append("<|channel|>commentary to=")
    if response_format is not None:
        structures.append(
            {
                "begin": "<|channel|>final<|constrain|>json<|message|>",
                "schema": json.loads(response_format.schema_json),
                "end": "<|return|>",
            }
        )
        triggers.append("<|channel|>final")
    if not structures:
        return None
    return json.dumps(
        {"type": "structural_tag", "structures": structures, "triggers": triggers}, separators=(",", ":")
    )


def tool_call_constraint(tools: Sequence[FunctionTool]) -> str | None:
    return output_constraint(tools)


def response_format_of(spec: dict[str, Any] | None, *, param: str, nested: bool) -> ResponseFormat | None:
    """Chat `response_format` ({type, json_schema: {name, schema, ...}}, `nested`) or Responses
    `text.format` ({type, name, schema, ...}) → the schema to describe and enforce; `text` → None."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise InvalidRequest("the response format must be an object", param=param)
    kind = spec.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ResponseFormat("json_object", "", '{"type":"object"}')
    if kind != "json_schema":
        raise InvalidRequest(f"unsupported response format type {kind!r}", param=f"{param}.type")
    body = spec.get("json_schema") if nested else spec
    where = f"{param}.json_schema" if nested else param
    if not isinstance(body, dict):
        raise InvalidRequest("json_schema formats need a json_schema object", param=where)
    schema = body.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest("json_schema formats need a JSON schema object", param=f"{where}.schema")
    name = body.get("name") or "response"
    if not isinstance(name, str):
        raise InvalidRequest("the format name must be a string", param=f"{where}.name")
    if schema_too_large(schema):
        raise InvalidRequest(
            f"response format schemas are at most {MAX_SCHEMA_CHARS} characters as JSON",
            param=f"{where}.schema",
        )
    return ResponseFormat(name, str(body.get("description") or ""), json.dumps(schema, separators=(",", ":")))


def prompt_cache_key_of(request: Any) -> str | None:
    """The request's `prompt_cache_key` (accepted as an extra field by every OpenAI schema), if a string."""
    if "prompt_cache_key" in type(request).model_fields:
        value = request.prompt_cache_key
    else:  # read the extras directly: a missing attribute costs pydantic an exception
        value = (request.model_extra or {}).get("prompt_cache_key")
    return value if isinstance(value, str) and value else None


def selection_text(history: Sequence[Msg]) -> str:
    return newest_user_text((msg.role, msg.text) for msg in reversed(history))


def newest_user_text(newest_first: Iterable[tuple[str, object]]) -> str:
    """The routing policies' selection text: the newest user message's text, clipped to
    SELECTION_TEXT_CHARS, from (role, content) pairs newest first; content that is not text is passed."""
    for role, content in newest_first:
        if role == "user" and isinstance(content, str):
            return content[:SELECTION_TEXT_CHARS]
    return ""


def sampling_options(
    group: ModelGroup,
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    seed: int | None = None,
    n: int = 1,
) -> SamplingOptions:
    """Every sampling field explicit: proto3 sends an unset number as 0 (top_p 0, n 0)."""
    defaults = group.info.default_sampling

    def pick(value: Any, key: str, fallback: Any) -> Any:
        if value is not None:
            return value
        default = defaults.get(key)
        return default if default is not None else fallback

    return SamplingOptions(
        temperature=float(pick(temperature, "temperature", 1.0)),
        top_p=float(pick(top_p, "top_p", 1.0)),
        top_k=int(pick(top_k, "top_k", -1)),
        min_p=float(pick(min_p, "min_p", 0.0)),
        repetition_penalty=float(pick(repetition_penalty, "repetition_penalty", 1.0)),
        frequency_penalty=float(pick(frequency_penalty, "frequency_penalty", 0.0)),
        presence_penalty=float(pick(presence_penalty, "presence_penalty", 0.0)),
        seed=seed,
        n=n,
    )


class SamplingFields(Protocol):
    """The sampling fields Chat Completions, completions and SGLang's `sampling_params` all carry, under
    the names of `sampling_options`'s keywords (the seed goes by other names)."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    n: int


def request_sampling(group: ModelGroup, request: SamplingFields, *, seed: int | None) -> SamplingOptions:
    """`sampling_options` from a request's sampling fields."""
    fields = {name: getattr(request, name) for name in SamplingFields.__annotations__}
    return sampling_options(group, seed=seed, **fields)


def token_budget(group: ModelGroup, prompt_len: int, requested: int | None, *, param: str) -> int | None:
    context = group.info.max_context_length
    if context and prompt_len >= context:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens; the model's context length is {context}",
            param=param,
            code="context_length_exceeded",
        )
    if requested is not None:
        if context:
            return min(requested, context - prompt_len)
        return requested
    return context - prompt_len if context else None


#: Stop strings the gateway matches itself in a request's output (Chat `stop`, Messages `stop_sequences`).
MAX_MATCHED_STOPS = 16


def stop_strings(stop: str | list[str] | None, *, param: str = "stop") -> tuple[str, ...]:
    """The stop strings the gateway matches in the answer text; raises InvalidRequest naming `param`."""
    if stop is None:
        return ()
    values = [stop] if isinstance(stop, str) else stop
    if len(values) > MAX_MATCHED_STOPS:
        raise InvalidRequest(f"at most {MAX_MATCHED_STOPS} stop sequences are supported", param=param)
    for value in values:
        if not isinstance(value, str) or not value:
            raise InvalidRequest("stop sequences must be non-empty strings", param=param)
    return tuple(values)


#: Characters of text the event loop encodes itself; more goes to a thread (quicktok encodes ~8 MB a
#: second here, so this holds the loop for about a millisecond at most).
LOOP_ENCODE_CHARS = 8192
#: Messages the event loop renders itself; more go to a thread. However short its text, a message whose
#: header was not rendered before (a tool name new to this process) costs openai-harmony about 0.3 ms.
LOOP_MESSAGES = 256


def renders_on_loop(renderer: PromptRenderer, prefix: PromptPrefix, messages: Sequence[Msg]) -> bool:
    """Whether rendering `messages` after `prefix` is cheap enough for the event loop: the prefix is
    cached, and the messages are few and short."""
    return (
        len(messages) <= LOOP_MESSAGES
        and renderer.has_prefix(prefix)
        and sum(len(m.text) for m in messages) <= LOOP_ENCODE_CHARS
    )


#: Prefix renders under way in worker threads, per renderer, by prefix key.
_prefix_renders: weakref.WeakKeyDictionary[PromptRenderer, dict[Hashable, asyncio.Future[list[int]]]] = (
    weakref.WeakKeyDictionary()
)


async def render_prefix_once(renderer: PromptRenderer, prefix: PromptPrefix) -> list[int]:
    """`renderer.render_prefix(prefix)` in a worker thread, one for all the requests that miss the cache
    together: a burst with a new system prompt (the first requests after a start, an agent's parallel
    calls) took a thread each (forty at c=64), which openai-harmony's renders then ran one after the
    other under the GIL. A request that leaves does not cancel the render the others wait for."""
    pending = _prefix_renders.setdefault(renderer, {})
    key = prefix.key  # computable: `has_prefix` computed it first
    render = pending.get(key)
    if render is None:
        render = asyncio.ensure_future(anyio.to_thread.run_sync(renderer.render_prefix, prefix))
        pending[key] = render

        def settled(done: asyncio.Future[list[int]]) -> None:
            pending.pop(key, None)
            if not done.cancelled():
                done.exception()  # retrieved: the waiters, if any are left, raise it

        render.add_done_callback(settled)
    return await asyncio.shield(render)


async def render_harmony(state: GatewayState, prefix: PromptPrefix, history: list[Msg]) -> list[int]:
    """`renderer.render_for_completion(prefix, history)`: on the loop when `renders_on_loop` (~10 µs),
    else in threads (openai-harmony renders a fresh system+developer prefix in about a millisecond, and
    a long history costs its length in encoding), the history in batches (`offload`), so one request
    never stalls the others. A short history after a fresh prefix stays on the loop: a burst of
    requests with a new system prompt does not fill the thread pool."""
    renderer = state.renderer
    if renders_on_loop(renderer, prefix, history):
        return renderer.render_for_completion(prefix, history)
    if renderer.has_prefix(prefix):
        tokens = list(renderer.render_prefix(prefix))
    else:
        tokens = list(await render_prefix_once(renderer, prefix))
        if renders_on_loop(renderer, prefix, history):  # the prefix is cached now
            return renderer.render_for_completion(prefix, history)
    for rendered in await map_off_loop(renderer.render_message, history):
        tokens += rendered
    tokens += assistant_header()
    return tokens


@dataclass(slots=True, eq=False)
class HarmonyTurn:
    """A request mapped to one Harmony turn by its surface's mapper (`chat_turn`,
    `anthropic.messages_turn`, the Responses plan): pure data, which `harmony_request` and
    `render_prompt` turn into the engine request the same way for every surface."""

    effort: str
    instructions: str | None
    history: list[Msg]
    #: The request's sampling fields over the model's defaults (`sampling_options`).
    sampling: SamplingOptions
    #: Client-side function tools, and client-side namespaces (`NAMESPACE.TOOL`): calls the client runs.
    tools: tuple[FunctionTool, ...] = ()
    namespaces: tuple[ToolNamespace, ...] = ()
    #: Namespaces of tools the gateway runs (MCP servers), and every namespace whose calls it runs
    #: (those plus the `browser` / `python` built-ins).
    gateway_namespaces: tuple[ToolNamespace, ...] = ()
    gateway_tool_names: frozenset[str] = frozenset()
    browser: bool = False
    python: bool = False
    response_format: ResponseFormat | None = None
    #: The tool choice forces a call: the engine constrains a call's header and arguments to `tools`.
    forces_call: bool = False
    #: The request fields that asked for a constraint (named when an engine cannot enforce it).
    tool_choice_param: str = "tool_choice"
    format_param: str = "response_format"
    #: The output budget the request asked for, and the field a prompt over the context is blamed on.
    max_tokens: int | None = None
    budget_param: str = "messages"
    #: The request's own stop token ids (the Harmony stops are always added) and stop strings.
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    max_reasoning_tokens: int | None = None
    #: The date a Responses chain or conversation started (the system message keeps it).
    started: str | None = None
    return_logprob: bool = False
    top_logprobs: int = 0


def harmony_request(state: GatewayState, group: ModelGroup, turn: HarmonyTurn) -> PreparedRequest:
    """The Harmony prepare tail, one for every surface: the prompt prefix (system: effort, date, built-in
    tools; developer: instructions, tools, output format), the stop ids, the output constraint and what
    the output parser must know. The prompt itself is rendered by `render_prompt`."""
    options = system_options(
        state, turn.effort, browser=turn.browser, python=turn.python, started=turn.started
    )
    prefix = PromptPrefix(
        options,
        turn.instructions,
        turn.tools,
        (*turn.namespaces, *turn.gateway_namespaces),
        turn.response_format,
    )
    sampling = turn.sampling
    sampling.stop_token_ids = [*turn.stop_token_ids, *ASSISTANT_STOP_IDS]
    sampling.structural_tag = output_constraint(turn.tools if turn.forces_call else (), turn.response_format)
    sampling.constraint_param = turn.tool_choice_param if turn.forces_call else turn.format_param
    return PreparedRequest(
        group=group,
        input_ids=[],
        sampling=sampling,
        selection_text="",
        stream=turn.stream,
        n=turn.n,
        function_names=frozenset(
            [t.name for t in turn.tools] + [f"{ns.name}.{t.name}" for ns in turn.namespaces for t in ns.tools]
        ),
        tool_namespaces=turn.gateway_tool_names,
        stop_strings=turn.stop_strings,
        max_reasoning_tokens=turn.max_reasoning_tokens,
        effort=turn.effort,
        return_logprob=turn.return_logprob,
        top_logprobs=turn.top_logprobs,
        prefix=prefix,
        original_text="[harmony]",
    )


async def render_prompt(
    state: GatewayState, prepared: PreparedRequest, history: list[Msg], max_tokens: int | None, *, param: str
) -> PreparedRequest:
    """`prepared` with the prompt of `history` rendered after its prefix and the output budget that leaves
    in the context (a prompt over the context is a 400 blamed on `param`). A new object: an earlier
    generation of the same response keeps its own."""
    assert prepared.prefix is not None
    input_ids = await render_harmony(state, prepared.prefix, history)
    budget = token_budget(prepared.group, len(input_ids), max_tokens, param=param)
    return dataclasses.replace(
        prepared,
        input_ids=input_ids,
        sampling=dataclasses.replace(prepared.sampling, max_new_tokens=budget),
        selection_text=prepared.selection_text or selection_text(history),
        history=history,
    )


async def prepare_harmony(state: GatewayState, group: ModelGroup, turn: HarmonyTurn) -> PreparedRequest:
    """`harmony_request` and `render_prompt` of one turn."""
    prepared = harmony_request(state, group, turn)
    return await render_prompt(state, prepared, turn.history, turn.max_tokens, param=turn.budget_param)
