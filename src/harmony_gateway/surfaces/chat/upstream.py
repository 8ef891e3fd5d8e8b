"""Stage 1, prepare, for models served by text-mode (HTTP) upstreams: the OpenAI request bodies to forward.

- Harmony models: the prompt is rendered exactly as for gRPC engines (`prepare.prepare_chat`), then
  decoded to text with its special tokens and sent to `/v1/completions` with `skip_special_tokens:
  false`, so the reply comes back as Harmony text; a worker configured with `api=chat` gets the chat
  request instead. The text-level Harmony parser (`--text-parser MODEL=...`, default `harmony`) turns
  the reply into reasoning, answer and tool calls.
- Other models: the chat request is forwarded to `/v1/chat/completions` as sent (the gateway's own
  extensions removed); the configured reasoning / tool-call parsers run over the answer text, and
  reasoning or tool calls the upstream parsed itself pass through.

Client `stop` strings are not forwarded: the gateway applies them to answer text (`text_output.py`).
A model's workers are all HTTP or all gRPC; mixing them is not supported.
"""

from __future__ import annotations

from typing import Any

from ...engines.base import SamplingOptions
from ...errors import InvalidRequest
from ...pipeline.context import GatewayState, PreparedRequest
from ...pipeline.output_spec import OutputSpec
from ...pipeline.prepare import sampling_options, stop_strings
from ...routing.fleet import ModelGroup
from .content import selection_text
from .types import ChatCompletionRequest

#: Request fields that only the gateway understands, never forwarded.
_GATEWAY_FIELDS = frozenset(
    {"model", "stream", "stream_options", "stop", "no_stop_trim", "max_reasoning_tokens", "include_reasoning"}
)


def is_text_group(group: ModelGroup) -> bool:
    """True when the model is served by text-mode (HTTP) workers."""
    return any(w.client.capabilities.wire == "text" for w in group.workers)


def require_token_engine(group: ModelGroup, route: str, instead: str) -> None:
    """Raise a 400 naming the route and the model (`param: "model"`) when the model is served by HTTP
    upstreams, which have no token-level interface; called before anything is dispatched."""
    if is_text_group(group):
        raise InvalidRequest(
            f"{route} is not available for model {group.name!r}: it is served by an HTTP upstream, "
            f"which has no token-level interface; {instead}",
            param="model",
        )


def _apis(group: ModelGroup) -> set[str]:
    return {w.client.capabilities.text_api for w in group.workers if w.client.capabilities.wire == "text"}


def chat_body(request: ChatCompletionRequest) -> dict[str, Any]:
    body = request.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    for key in _GATEWAY_FIELDS:
        body.pop(key, None)
    return body


def non_harmony_prepared(
    request: ChatCompletionRequest,
    group: ModelGroup,
    sampling: SamplingOptions,
    spec: OutputSpec,
    *,
    input_ids: list[int],
    original_text: str,
    top_logprobs: int,
    upstream_body: dict[str, dict[str, Any]] | None = None,
) -> PreparedRequest:
    """A chat request to a non-Harmony model, prepared: its prompt rendered by the chat template
    (`input_ids`), or its body forwarded to an HTTP upstream (`upstream_body`); `spec` parses the text."""
    return PreparedRequest(
        group=group,
        input_ids=input_ids,
        sampling=sampling,
        selection_text=selection_text(request),
        stream=request.stream,
        n=request.n,
        harmony=False,
        stop_strings=stop_strings(request.stop),
        return_logprob=bool(request.logprobs),
        top_logprobs=top_logprobs,
        original_text=original_text,
        output_adapter=spec,
        upstream_body=upstream_body,
    )


def prepare_chat_passthrough(
    state: GatewayState, request: ChatCompletionRequest, group: ModelGroup, spec: OutputSpec
) -> PreparedRequest:
    sampling = sampling_options(group, temperature=request.temperature, top_p=request.top_p, n=request.n)
    return non_harmony_prepared(
        request,
        group,
        sampling,
        spec,
        input_ids=[],
        original_text="",
        top_logprobs=request.top_logprobs or 0,
        upstream_body={"chat": chat_body(request)},
    )


def completions_body(state: GatewayState, prepared: PreparedRequest) -> dict[str, Any]:
    """`/v1/completions` with the rendered Harmony prompt; sampling as the gRPC path sends it."""
    s = prepared.sampling
    body: dict[str, Any] = {
        "prompt": state.encoding.decode(prepared.input_ids),
        "temperature": s.temperature,
        "top_p": s.top_p,
        "n": s.n,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        # Extensions most OpenAI-compatible servers accept (vLLM, SGLang, llama.cpp) or ignore.
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "stop_token_ids": list(s.stop_token_ids),
    }
    if s.top_k > 0:
        body["top_k"] = s.top_k
    if s.min_p:
        body["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty
    if s.max_new_tokens is not None:
        body["max_tokens"] = s.max_new_tokens
    if s.seed is not None:
        body["seed"] = s.seed
    return body


def attach_harmony_upstream(
    state: GatewayState, prepared: PreparedRequest, request: ChatCompletionRequest
) -> None:
    """Turn a prepared Harmony request into a text-mode one (module docstring)."""
    if prepared.max_reasoning_tokens is not None:
        raise InvalidRequest(
            "max_reasoning_tokens needs a gRPC engine; this model is served over HTTP",
            param="max_reasoning_tokens",
        )
    group = prepared.group
    apis = _apis(group)
    bodies: dict[str, dict[str, Any]] = {}
    if apis - {"chat"}:
        bodies["completions"] = completions_body(state, prepared)
    if "chat" in apis:
        bodies["chat"] = chat_body(request)
    prepared.upstream_body = bodies
    extra = request.model_extra or {}
    prepared.output_adapter = OutputSpec.configured(
        state.settings,
        tokenizer=None,
        text_kind=state.settings.text_parsers.get(group.name, "harmony"),
        no_stop_trim=bool(extra.get("no_stop_trim")),
    )


__all__ = [
    "attach_harmony_upstream",
    "chat_body",
    "completions_body",
    "is_text_group",
    "non_harmony_prepared",
    "prepare_chat_passthrough",
    "require_token_engine",
]
