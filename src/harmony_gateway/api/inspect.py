"""The prompt inspector: what a request would send to the engine, without sending it, and what raw model
output parses into.

`render_request` runs the same prepare functions the generating routes run (`prepare_chat`,
`prepare_responses` + `render_turn`, `prepare_messages`) and asks the model group's routing policy which
worker it would pick (`peek`, which moves no counter or cache), so the inspector cannot disagree with the
real path. This module is the only place that knows where those functions live.

What `routing` shows depends on who asks. A tenant sees only what its own request decides: the model
group, each pool's policy, its routing key and `cache_match_tokens`, the prefix of its prompt that the
policy records in the tenant's own namespace (routing/cache_aware.py), so it tells the tenant about its
own earlier requests and nothing about anybody else's. Which worker the policy would pick, the workers'
URLs, availability and in-flight counts depend on every tenant's traffic and are the admin plane's
(`GET /workers`): they are added (`worker`, and `worker` and `workers` per pool) only with `fleet=True`,
which the route sets for a request holding the admin credential.

The inspector never connects to an MCP server a request names (`server_url`): rendering is cheap and
open to every tenant, and a connection per render would make it a relay to any host. Such a tool is
refused with a 400; servers configured on the gateway (`server_label` alone) render from the gateway's
own pooled connections, as a real request would.

`parse_output` feeds model output to the gateway's own parsers: token ids to `HarmonyOutputParser`, text
with Harmony markers spelled out to the same parser after encoding them, text without markers (an HTTP
upstream that stripped them) to `HarmonyTextParser`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import Any

import anyio
import quicktok

from ..errors import InvalidRequest, NoHealthyWorker, UpstreamBadOutput
from ..harmony import token_parser as tp
from ..harmony.encoding import CALL, END, RETURN, START, VOCAB_SIZE, client_text, is_special
from ..harmony.text_events import (
    ContentDelta,
    ReasoningDelta,
    Terminated,
    ToolCallArgumentsDelta,
    ToolCallStart,
)
from ..harmony.text_parser import HarmonyTextParser
from ..pipeline.context import GatewayState, PreparedRequest, RequestContext
from ..pipeline.select_worker import routing_request
from ..routing.policy import RoutingPolicy, RoutingRequest
from ..surfaces.table import SURFACES

#: The surfaces the inspector renders, by name (the surface table's rows that have an `inspect`).
INSPECTABLE = {surface.name: surface for surface in SURFACES if surface.inspect is not None}
#: Longer prompts are described (decoded, cut into tokens and messages) in a worker thread.
LOOP_DESCRIBE_TOKENS = 4096
#: A text to parse may hold this many characters per token of `Settings.max_parse_tokens`.
PARSE_CHARS_PER_TOKEN = 8
#: Ids parsed between two releases of the GIL (at most about two milliseconds of work): the parse runs in a worker
#: thread, and the event loop's thread should not wait the interpreter's 5 ms switch interval for it.
PARSE_SLICE = 256
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")


# -- render --------------------------------------------------------------------------------------------
async def render_request(
    state: GatewayState, api: Any, request: Any, ctx: RequestContext, *, fleet: bool = False
) -> dict[str, Any]:
    """The prompt, sampling and routing the engine would get for `request` on surface `api`; `fleet`
    adds the worker choice and the pools' workers (admins only, see the module docstring)."""
    surface = INSPECTABLE.get(api) if isinstance(api, str) else None
    if surface is None or surface.inspect is None:
        raise InvalidRequest(f"api must be one of {', '.join(INSPECTABLE)}", param="api")
    if not isinstance(request, dict):
        raise InvalidRequest("request must be the JSON body of that API's request", param="request")
    notes: list[str] = []
    prepared = await surface.inspect(state, request, ctx, notes)
    ctx.model = prepared.group.name
    body = describe(state, prepared, ctx, api, notes, fleet=fleet)
    views = functools.partial(prompt_views, state, prepared)
    if len(prepared.input_ids) <= LOOP_DESCRIBE_TOKENS:
        body.update(views())
    else:
        body.update(await anyio.to_thread.run_sync(views))
    return body


def describe(
    state: GatewayState,
    prepared: PreparedRequest,
    ctx: RequestContext,
    api: str,
    notes: list[str],
    *,
    fleet: bool = False,
) -> dict[str, Any]:
    ids = list(prepared.input_ids)
    sampling = dataclasses.asdict(prepared.sampling)
    body: dict[str, Any] = {
        "object": "harmony.render",
        "api": api,
        "model": prepared.group.name,
        "harmony": prepared.harmony,
        "token_count": len(ids),
        "token_ids": ids,
        "stop_token_ids": list(prepared.sampling.stop_token_ids),
        "sampling": {
            **sampling,
            "stream": prepared.stream,
            "return_logprob": prepared.return_logprob,
            "top_logprobs": prepared.top_logprobs,
            "stop_strings": list(prepared.stop_strings),
            "max_reasoning_tokens": prepared.max_reasoning_tokens,
            "reasoning_effort": prepared.effort,
        },
        "constraint": _constraint(prepared),
        "routing": routing_of(prepared, ctx, fleet=fleet),
        "notes": notes,
    }
    if prepared.upstream_body is not None:
        notes.append(
            "this model is served by an HTTP upstream: it is sent the request as text, not these ids"
        )
    return body


def _constraint(prepared: PreparedRequest) -> dict[str, Any] | None:
    s = prepared.sampling
    constraints = (("structural_tag", s.structural_tag), ("json_schema", s.json_schema), ("regex", s.regex))
    for kind, value in constraints:
        if value:
            return {"type": kind, "value": value}
    return None


def routing_of(prepared: PreparedRequest, ctx: RequestContext, *, fleet: bool = False) -> dict[str, Any]:
    """The group, each pool's policy and, for cache_aware, the prefix it records for the request's
    tenant. With `fleet`, also the worker each pool's policy would pick now (None when none is
    available: the real request would be a 503) and the pools' workers."""
    group = prepared.group
    request = routing_request(prepared, ctx)
    pools: list[tuple[str, Any, list[Any]]] = (
        [("prefill", group.prefill_policy, group.prefill), ("decode", group.decode_policy, group.decode)]
        if group.disaggregated
        else [("regular", group.policy, group.regular)]
    )
    out: dict[str, Any] = {
        "model_group": group.name,
        "routing_key": ctx.routing_key,
        "disaggregated": group.disaggregated,
    }
    for role, policy, pool in pools:
        out[role] = {"policy": policy.name, "cache_match_tokens": policy.match_length(pool, request)}
        if fleet:
            out[role] |= _fleet(policy, pool, request)
    main = out["decode" if group.disaggregated else "regular"]
    out["policy"] = main["policy"]
    out["cache_match_tokens"] = main["cache_match_tokens"]
    if fleet:
        out["worker"] = main["worker"]
    return out


def _fleet(policy: RoutingPolicy, pool: list[Any], request: RoutingRequest) -> dict[str, Any]:
    """The admin's part of a pool's routing: the worker `peek` picks and every worker's state."""
    worker = None
    try:
        chosen = policy.peek(pool, request)
        worker = {"id": chosen.id, "url": chosen.public_url}
    except NoHealthyWorker:
        worker = None
    return {
        "worker": worker,
        "workers": [
            {"id": w.id, "url": w.public_url, "available": w.available(), "in_flight": w.in_flight}
            for w in pool
        ],
    }


def prompt_views(state: GatewayState, prepared: PreparedRequest) -> dict[str, Any]:
    """The prompt as text, as [id, text] tokens and cut into messages: linear in the prompt, but a few
    hundred milliseconds at a full context, so `render_request` runs it in a thread for long prompts."""
    ids = prepared.input_ids
    if prepared.harmony:
        return {
            "prompt_text": state.encoding.decode(ids),
            "tokens": token_pieces(state, ids),
            "messages": split_messages(state, ids),
        }
    # A chat-template model: the template's text, tokenized by the model's own tokenizer (loaded by the
    # prepare stage); there are no Harmony messages to list.
    tokenizer = state.tokenizers.get(prepared.group.name)
    token_text = tokenizer.token_text if tokenizer is not None else None
    return {
        "prompt_text": prepared.original_text,
        "tokens": [[i, token_text(i) if token_text is not None else None] for i in ids],
        "messages": [],
    }


def token_pieces(state: GatewayState, ids: list[int]) -> list[list[Any]]:
    """[id, text] per token: special tokens by name, ordinary ones as their bytes (a partial UTF-8
    sequence shows as U+FFFD; the full text is in `prompt_text`)."""
    token_bytes = quicktok.get_encoding("o200k_base").decode_single_token_bytes
    decode = state.encoding.decode
    return [[i, decode([i]) if is_special(i) else token_bytes(i).decode("utf-8", "replace")] for i in ids]


_HEADER = re.compile(r"<\|start\|>(?P<role>[^\s<]+)(?P<rest>.*)", re.DOTALL)


def split_messages(state: GatewayState, ids: list[int]) -> list[dict[str, Any]]:
    """The prompt cut at every `<|start|>` (message text is encoded as ordinary text, so the token
    appears only at message boundaries): one entry per message, the last being the generation header."""
    starts = [i for i, t in enumerate(ids) if t == START] + [len(ids)]
    messages = []
    for begin, end in zip(starts, starts[1:], strict=False):
        segment = ids[begin:end]
        text = state.encoding.decode(segment)
        messages.append({**_header_fields(text), "start": begin, "token_count": len(segment)})
    return messages


def _header_fields(text: str) -> dict[str, Any]:
    head, sep, content = text.partition("<|message|>")
    match = _HEADER.match(head)
    role = match.group("role") if match else ""
    rest = match.group("rest") if match else head
    recipient = None
    found = re.search(r"\bto=(\S+?)(?=<\||\s|$)", rest)
    if found:
        recipient = found.group(1)
    channel = None
    if "<|channel|>" in rest:
        channel = re.split(r"\s|<\|", rest.split("<|channel|>", 1)[1], maxsplit=1)[0] or None
    content_type = None
    if "<|constrain|>" in rest:
        content_type = rest.split("<|constrain|>", 1)[1].strip() or None
    terminator = None
    for end in ("<|end|>", "<|call|>", "<|return|>"):
        if content.endswith(end):
            content, terminator = content[: -len(end)], end
            break
    return {
        "role": role,
        "channel": channel,
        "recipient": recipient,
        "content_type": content_type,
        "text": content if sep else "",
        "terminator": terminator,
        "generation_header": not sep,
    }


# -- parse ---------------------------------------------------------------------------------------------
def parse_output(
    state: GatewayState, body: dict[str, Any], function_names: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Messages and the repairs the parser made for raw model output (`token_ids` or `text`), at most
    `Settings.max_parse_tokens` of them (a debugging aid, not a bulk service). CPU-bound, linear in the
    output's length: callers on the event loop run it in a worker thread."""
    token_ids = body.get("token_ids")
    text = body.get("text")
    if (token_ids is None) == (text is None):
        raise InvalidRequest("send exactly one of token_ids or text", param="token_ids")
    max_tokens = state.settings.max_parse_tokens
    if token_ids is not None:
        if isinstance(token_ids, list) and len(token_ids) > max_tokens:
            raise InvalidRequest(
                f"token_ids holds {len(token_ids)} ids; at most {max_tokens} can be parsed", param="token_ids"
            )
        # Checked with C-level passes (`map`, `min`, `max`) so the GIL is held briefly; the loop that names
        # the bad id runs only when there is one.
        if not isinstance(token_ids, list) or not set(map(type, token_ids)) <= {int}:
            raise InvalidRequest("token_ids must be a list of integers", param="token_ids")
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= VOCAB_SIZE):
            j, t = next((j, t) for j, t in enumerate(token_ids) if not 0 <= t < VOCAB_SIZE)
            raise InvalidRequest(f"token id {t} is outside the vocabulary", param=f"token_ids[{j}]")
        ids = token_ids
        source = "token_ids"
    else:
        if not isinstance(text, str):
            raise InvalidRequest("text must be a string", param="text")
        if len(text) > max_tokens * PARSE_CHARS_PER_TOKEN:
            raise InvalidRequest(
                f"text must be at most {max_tokens * PARSE_CHARS_PER_TOKEN} characters", param="text"
            )
        if not _SPECIAL.search(text):
            return _parse_stripped(text)
        # The fast encoder, as for prompts: openai-harmony's own BPE is quadratic in a piece's length.
        with client_text("text"):
            ids = state.renderer.encode_with_special_tokens(text)
        source = "text"
        if len(ids) > max_tokens:
            raise InvalidRequest(f"text encodes to more than {max_tokens} tokens", param="text")
    return _parse_tokens(state, ids, source, function_names)


_KINDS = {
    tp.REASONING: "reasoning",
    tp.ANSWER: "answer",
    tp.PREAMBLE: "preamble",
    tp.FUNCTION_CALL: "function_call",
    tp.TOOL_CALL: "tool_call",
    tp.DROPPED: "dropped",
}
_TERMINATOR_NAMES = {END: "<|end|>", CALL: "<|call|>", RETURN: "<|return|>"}


def _parse_tokens(
    state: GatewayState, ids: list[int], source: str, function_names: frozenset[str]
) -> dict[str, Any]:
    # The output starts after the prompt's `<|start|>assistant`; a leading `<|start|>assistant` is the
    # model starting its next message, which the parser accepts as well.
    parser = tp.HarmonyOutputParser(state.encoding, function_names)
    recoveries: list[dict[str, Any]] = []
    try:
        for at in range(0, len(ids), PARSE_SLICE):
            parser.feed(ids[at : at + PARSE_SLICE])
            time.sleep(0)  # let the event loop's thread take the GIL now, not after a switch interval
        parser.finish()
    except UpstreamBadOutput as exc:
        recoveries.append({"kind": "not_harmony", "detail": exc.message, "fatal": True})
    messages = []
    for index, msg in enumerate(parser.messages):
        messages.append(
            {
                "role": "assistant" if msg.kind != tp.DROPPED else None,
                "kind": _KINDS.get(msg.kind, str(msg.kind)),
                "channel": msg.channel,
                "recipient": msg.recipient,
                "content_type": msg.content_type,
                "text": msg.text,
                "tokens": msg.tokens,
                "terminator": _TERMINATOR_NAMES.get(msg.terminator) if msg.terminator is not None else None,
            }
        )
        if not msg.terminated:
            recoveries.append(
                {"kind": "unterminated_message", "message": index, "detail": "closed at the end of output"}
            )
        if msg.kind == tp.DROPPED:
            recoveries.append(
                {"kind": "dropped_message", "message": index, "detail": "written in another role's name"}
            )
        if msg.name == tp.INVALID_TOOL_NAME:
            recoveries.append({"kind": "invalid_tool_name", "message": index, "detail": msg.recipient})
    if parser.ignored_tokens:
        recoveries.append(
            {
                "kind": "trailing_tokens_ignored",
                "count": parser.ignored_tokens,
                "detail": "tokens after the output stopped being parseable",
            }
        )
    # The parser's own repairs by kind (`token_parser.RECOVERED_*`: a broken header, stray text, answer
    # text with no header...), as the metrics count them.
    recoveries += [
        {"kind": kind, "count": count, "fatal": False} for kind, count in parser.recoveries.items()
    ]
    if parser.parse_error and not any(r["kind"] == "not_harmony" for r in recoveries):
        recoveries.append({"kind": "parse_error", "detail": parser.parse_error, "fatal": False})
    return {
        "object": "harmony.parse",
        "source": source,
        "parser": "token",
        "token_count": len(ids),
        "messages": messages,
        "recoveries": recoveries,
        "reasoning_tokens": parser.reasoning_tokens,
    }


def _parse_stripped(text: str) -> dict[str, Any]:
    """Text without special-token spellings: what an HTTP upstream sends when it strips them; parsed by
    the text-level parser those upstreams use."""
    parser = HarmonyTextParser()
    events = [*parser.feed(text), *parser.finish()]
    messages: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    calls: dict[int, dict[str, Any]] = {}
    terminated = None

    def open_message(kind: str, channel: str | None) -> dict[str, Any]:
        nonlocal current
        if current is None or current["kind"] != kind:
            current = {
                "role": "assistant",
                "kind": kind,
                "channel": channel,
                "recipient": None,
                "content_type": None,
                "text": "",
            }
            messages.append(current)
        return current

    for event in events:
        if isinstance(event, ReasoningDelta):
            open_message("reasoning", "analysis")["text"] += event.text
        elif isinstance(event, ContentDelta):
            open_message("answer", "final")["text"] += event.text
        elif isinstance(event, ToolCallStart):
            current = {
                "role": "assistant",
                "kind": "function_call",
                "channel": "commentary",
                "recipient": f"functions.{event.name}",
                "content_type": "json",
                "text": "",
            }
            calls[event.index] = current
            messages.append(current)
        elif isinstance(event, ToolCallArgumentsDelta):
            calls[event.index]["text"] += event.text
        elif isinstance(event, Terminated):
            terminated = event.reason
    stats = parser.stats
    counts = {
        "parse_errors": stats.parse_errors,
        "marker_fallbacks": stats.marker_fallbacks,
        "passthrough_fallbacks": stats.passthrough_fallbacks,
        "unknown_channels": stats.unknown_channels,
        "unexpected_order": stats.unexpected_order,
        "trailing_ignored_chars": stats.trailing_ignored_chars,
    }
    recoveries = [{"kind": name, "count": count} for name, count in counts.items() if count]
    return {
        "object": "harmony.parse",
        "source": "text",
        "parser": f"text ({parser.mode})",
        "messages": messages,
        "recoveries": recoveries,
        "terminated": terminated,
    }
