"""Stage 1, prepare, for non-Harmony models: chat messages → the model's chat template → prompt ids.

Templates are rendered as transformers' `apply_chat_template` does: a sandboxed jinja2 environment with
`trim_blocks` / `lstrip_blocks` and the loop-controls extension, the `tojson` filter (non-ASCII kept),
`raise_exception(message)` (→ 400) and `strftime_now(format)`, and the variables `messages`, `tools`
(OpenAI `{"type": "function", "function": {...}}` dicts, or undefined when there are none),
`add_generation_prompt=True`, `bos_token`, `eos_token`, plus the request's `chat_template_kwargs`
(e.g. `enable_thinking`). Messages keep their OpenAI shape, except that text parts are joined,
`developer` becomes `system`, and tool-call `arguments` are parsed into objects as vLLM does (templates
print them with `tojson`). Tool choice selects which tools are rendered; nothing constrains decoding.

Every string the request supplies (message text, names, ids, reasoning, tool definitions and call
arguments, `chat_template_kwargs`, dict keys included) is disarmed first (`ModelTokenizer.disarm`), so
control tokens' text in it encodes as text and only the template's own markup becomes their ids.

For models behind an HTTP upstream no template is needed: the chat request is forwarded (see
`surfaces/chat/upstream.py`). Raises `InvalidRequest` naming the offending field.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import anyio
import jinja2
import jinja2.sandbox
from jinja2.ext import loopcontrols

from ...errors import InvalidRequest, UpstreamError
from ...observability.tracing import traced
from ...pipeline.context import GatewayState, PreparedRequest
from ...pipeline.output_spec import OutputSpec
from ...pipeline.prepare import (
    apply_tool_choice,
    request_sampling,
    token_budget,
)
from ...pipeline.tokenizer import TOKEN_BREAK, ModelTokenizer
from ...pipeline.tokenizer_cache import model_tokenizer
from ...routing.fleet import ModelGroup
from .content import chat_function_tools, text_of
from .types import ChatCompletionRequest
from .upstream import is_text_group, non_harmony_prepared, prepare_chat_passthrough

#: Above this many characters of messages, rendering and tokenizing move to a worker thread.
THREAD_CHARS = 8000


class TemplateError(Exception):
    """Raised by a template's `raise_exception` call."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return dt.datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


def compiled_template(tok: ModelTokenizer, *, with_tools: bool) -> jinja2.Template:
    template = tok.chat_template
    if isinstance(template, dict):
        name = "tool_use" if with_tools and "tool_use" in template else "default"
        source = template.get(name) or next(iter(template.values()), None)
    else:
        name, source = "default", template
    if not source:
        raise UpstreamError(f"the tokenizer in {tok.source} has no chat_template")
    compiled = tok.compiled.get(name)
    if compiled is None:
        try:
            compiled = tok.compiled[name] = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise UpstreamError(f"the chat template in {tok.source} does not compile: {exc}") from exc
    return compiled


def template_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Chat messages as templates expect them (module docstring)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        role = message.role
        entry: dict[str, Any] = {
            "role": "system" if role == "developer" else ("tool" if role == "function" else role),
            "content": text_of(message.content, param=f"messages[{i}].content", allow_refusal=True),
        }
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning_content or message.reasoning
        if reasoning:
            entry["reasoning_content"] = reasoning
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                arguments: Any = call.function.arguments or "{}"
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass  # templates print whatever they get
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            entry["tool_calls"] = calls
        out.append(entry)
    return out


def template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    chosen = {t.name for t in apply_tool_choice(chat_function_tools(request), request.tool_choice)}
    tools = [
        {"type": "function", "function": tool.function.model_dump(exclude_none=True)}
        for tool in request.tools or ()
        if tool.function is not None and tool.function.name in chosen
    ]
    return tools or None


def _disarmed(tok: ModelTokenizer, value: Any) -> Any:
    """`value` (request JSON: dicts, lists, strings, numbers) with every string disarmed."""
    if isinstance(value, str):
        return tok.disarm(value)
    if isinstance(value, dict):
        return {_disarmed(tok, k): _disarmed(tok, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_disarmed(tok, v) for v in value]
    return value


def _render(tok: ModelTokenizer, request: ChatCompletionRequest) -> str:
    """The template's output, request text disarmed (see `ModelTokenizer.encode_rendered`)."""
    tools = template_tools(request)
    template = compiled_template(tok, with_tools=tools is not None)
    extra = (request.model_extra or {}).get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    variables: dict[str, Any] = {
        **_disarmed(tok, extra),
        "messages": _disarmed(tok, template_messages(request)),
        "add_generation_prompt": True,
        "bos_token": tok.bos_token or "",
        "eos_token": tok.eos_token or "",
    }
    if tools is not None:
        variables["tools"] = _disarmed(tok, tools)
    try:
        return template.render(**variables)
    except TemplateError as exc:
        raise InvalidRequest(
            f"the model's chat template rejected the messages: {exc}", param="messages"
        ) from None
    except jinja2.TemplateError as exc:
        raise InvalidRequest(
            f"the model's chat template failed on the messages: {exc}", param="messages"
        ) from None


def render_chat(tok: ModelTokenizer, request: ChatCompletionRequest) -> str:
    """The prompt text. Raises InvalidRequest when the template rejects the conversation."""
    return _render(tok, request).replace(TOKEN_BREAK, "")


def render_and_encode(tok: ModelTokenizer, request: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The prompt text and its ids: special ids only where the template wrote them."""
    rendered = _render(tok, request)
    return rendered.replace(TOKEN_BREAK, ""), tok.encode_rendered(rendered)


def output_spec(
    state: GatewayState, group: ModelGroup, request: ChatCompletionRequest, tok: Any
) -> OutputSpec:
    settings = state.settings
    extra = request.model_extra or {}
    return OutputSpec.configured(
        settings,
        tokenizer=tok,
        text_kind=settings.text_parsers.get(group.name),
        reasoning_parser=settings.reasoning_parsers.get(group.name),
        tool_call_parser=settings.tool_call_parsers.get(group.name),
        no_stop_trim=bool(extra.get("no_stop_trim")),
    )


@traced("gateway.prepare")
async def prepare_chat_template(
    state: GatewayState, request: ChatCompletionRequest, group: ModelGroup
) -> PreparedRequest:
    if request.max_reasoning_tokens is not None:
        raise InvalidRequest(
            "max_reasoning_tokens is supported for Harmony models only", param="max_reasoning_tokens"
        )
    if is_text_group(group):
        return prepare_chat_passthrough(state, request, group, output_spec(state, group, request, None))
    tok = await model_tokenizer(state, group)
    chars = sum(len(m.content) if isinstance(m.content, str) else 200 for m in request.messages)
    if chars > THREAD_CHARS:
        prompt, input_ids = await anyio.to_thread.run_sync(render_and_encode, tok, request)
    else:
        prompt, input_ids = render_and_encode(tok, request)
    sampling = request_sampling(group, request, seed=request.seed)
    requested = request.max_completion_tokens or request.max_tokens
    sampling.max_new_tokens = token_budget(group, len(input_ids), requested, param="messages")
    sampling.stop_token_ids = list(request.stop_token_ids or ())
    sampling.ignore_eos = bool(request.ignore_eos)
    # Special tokens (the end-of-turn token) never become text; ids stay ids for logprobs.
    sampling.skip_special_tokens = True
    return non_harmony_prepared(
        request,
        group,
        sampling,
        output_spec(state, group, request, tok),
        input_ids=input_ids,
        original_text=prompt,
        top_logprobs=request.top_logprobs or 0 if request.logprobs else 0,
    )


__all__ = [
    "TemplateError",
    "compiled_template",
    "prepare_chat_template",
    "render_and_encode",
    "render_chat",
    "template_messages",
    "template_tools",
]
