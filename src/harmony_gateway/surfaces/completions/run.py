"""OpenAI's legacy `POST /v1/completions` over the raw-prompt stage (`pipeline/raw_prompt.py`).

`text_completion` objects; choice index = prompt index * n + sample; `echo` prepends the prompt text;
`logprobs` follows the legacy shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); echoed
prompt tokens have null logprobs (prompt logprobs are not computed).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ...engines.base import EngineChunk
from ...errors import InvalidRequest
from ...pipeline.batch import Batch
from ...pipeline.context import GatewayState, PreparedRequest, RequestContext
from ...pipeline.drive import Generation, Planned
from ...pipeline.prepare import request_sampling
from ...pipeline.raw_prompt import (
    Decoder,
    Prompt,
    RawFramer,
    RawSample,
    check_batch_size,
    decode_all,
    decoder_factory,
    encode_prompt_off_loop,
    finish_context,
    new_batch,
    raw_prepared,
    raw_tokenizer,
    stop_list,
)
from ...sse import DATA_FIELD, DONE, EVENT_END, data_frame
from ..chat.upstream import is_text_group
from .types import CompletionRequest

_dumps = orjson.dumps


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("the prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _logprob_lists() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


class _LogprobBuilder:
    """Legacy completions logprobs for one choice: tokens, token_logprobs, top_logprobs, text_offset."""

    __slots__ = ("decoder", "offset", "out")

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.offset = 0
        self.out = _logprob_lists()

    def add_prompt(self, ids: Sequence[int]) -> dict[str, list[Any]]:
        part = _logprob_lists()
        for token in ids:
            text = self.decoder.token_text(token)
            self._append(part, text, None, None)
        return part

    def add(self, logprobs: Sequence[Any]) -> dict[str, list[Any]]:
        part = _logprob_lists()
        for lp in logprobs:
            top = {self.decoder.token_text(t): v for t, v in lp.top} if lp.top else {}
            self._append(part, self.decoder.token_text(lp.token_id), lp.logprob, top)
        return part

    def _append(self, part: dict[str, list[Any]], text: str, logprob: float | None, top: Any) -> None:
        for target in (part, self.out):
            target["tokens"].append(text)
            target["token_logprobs"].append(logprob)
            target["top_logprobs"].append(top)
            target["text_offset"].append(self.offset)
        self.offset += len(text)


def completions_passthrough_body(
    request: CompletionRequest, prompt: Prompt, prepared: PreparedRequest
) -> dict[str, Any]:
    """The `/v1/completions` body for an HTTP upstream: the client's fields (gateway-only ones removed),
    one prompt, the token budget, and for Harmony models the raw-text extensions and assistant stop ids."""
    body = request.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    for key in ("model", "stream", "stream_options", "prompt"):
        body.pop(key, None)
    body["prompt"] = prompt
    sampling = prepared.sampling
    if sampling.max_new_tokens is not None:
        body["max_tokens"] = sampling.max_new_tokens
    if prepared.harmony:
        body.setdefault("skip_special_tokens", False)
        body["spaces_between_special_tokens"] = False
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    return body


def _completion_finish(sample: RawSample) -> str:
    return "length" if sample.finish_reason == "length" else "stop"


async def plan_completions(state: GatewayState, request: CompletionRequest, ctx: RequestContext) -> Planned:
    group = state.fleet.group(request.model)
    ctx.model = group.name
    if request.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise InvalidRequest("best_of is not supported (only best_of == n)", param="best_of")
    prompts = _completion_prompts(request.prompt)
    n = request.n
    check_batch_size(state, len(prompts), n, param="prompt")
    logprobs = request.logprobs
    passthrough = is_text_group(group)
    if passthrough and logprobs is not None:
        raise InvalidRequest(
            f"logprobs are not available for {group.name!r}: it is served by an HTTP upstream",
            param="logprobs",
        )
    tok = None if passthrough else await raw_tokenizer(state, group)
    prepared, prompt_ids = [], []
    for i, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if passthrough:
            ids = [] if isinstance(prompt, str) else list(prompt)  # the upstream tokenizes
        else:
            ids = await encode_prompt_off_loop(state, group, prompt, param=param, tok=tok)
        prompt_ids.append(ids)
        sampling = request_sampling(group, request, seed=request.seed)
        sampling.stop = stop_list(request.stop)
        sampling.stop_token_ids = list(request.stop_token_ids or ())
        sampling.ignore_eos = request.ignore_eos
        item = raw_prepared(
            state,
            group,
            ids,
            sampling,
            requested_tokens=request.max_tokens,
            stream=request.stream,
            return_logprob=logprobs is not None,
            top_logprobs=logprobs or 0,
            original_text=prompt if isinstance(prompt, str) else "",
            param=param,
        )
        if passthrough:
            item.upstream_body = {"completions": completions_passthrough_body(request, prompt, item)}
        prepared.append(item)
    new_decoder = decoder_factory(state, tok, request.skip_special_tokens)
    samples = [[RawSample(new_decoder()) for _ in range(n)] for _ in prompts]
    # An upstream echoes the prompt itself (`echo` is forwarded).
    echo = request.echo and not passthrough
    echoes = [decode_all(new_decoder(), ids) if echo else "" for ids in prompt_ids]
    builders = [[_LogprobBuilder(new_decoder()) for _ in range(n)] for _ in prompts]
    opened = new_batch(state, ctx, prepared, stream=request.stream)
    completion_id = "cmpl-" + ctx.request_id
    created = int(time.time())
    head = {"id": completion_id, "object": "text_completion", "created": created, "model": group.name}
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    framer = CompletionsFramer(
        ctx,
        opened,
        samples,
        builders,
        echoes,
        prompt_ids,
        head,
        want_logprobs=logprobs is not None,
        include_usage=include_usage,
        streaming=request.stream,
    )

    async def body() -> dict[str, Any]:
        finish_context(ctx, opened)
        choices = []
        for i in range(len(prompts)):
            for j in range(n):
                sample = samples[i][j]
                choice_logprobs = None
                if logprobs is not None:
                    builder = builders[i][j]
                    if request.echo:
                        builder.add_prompt(prompt_ids[i])
                    builder.add(sample.logprobs)
                    choice_logprobs = builder.out
                choices.append(
                    {
                        "index": i * n + j,
                        "text": echoes[i] + sample.text,
                        "logprobs": choice_logprobs,
                        "finish_reason": _completion_finish(sample),
                    }
                )
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": group.name,
            "choices": choices,
            "usage": _completion_usage(opened, samples),
        }

    return Generation(opened.source, framer, body=None if request.stream else body)


def _completion_usage(opened: Batch, samples: list[list[RawSample]]) -> dict[str, Any]:
    prompt = sum(
        (group[0].prompt_tokens or len(p.input_ids))
        for p, group in zip(opened.prepared, samples, strict=True)
    )
    completion = sum(s.tokens for group in samples for s in group)
    cached = sum(max(s.cached_tokens for s in group) for group in samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass(slots=True, eq=False)
class CompletionsFramer(RawFramer):
    """`text_completion` chunks: the echoed prompt before a choice's first text, its text (and legacy
    logprobs) per engine chunk, a finish chunk as it ends, then usage when asked and `[DONE]`; a
    failure is the error event. Not streaming (`streaming` false) it only feeds the samples."""

    #: Each sample's legacy logprobs, as `samples`.
    builders: list[list[_LogprobBuilder]]
    #: Each prompt's echoed text ("" without `echo`) and its ids.
    echoes: list[str]
    prompt_ids: list[list[int]]
    #: The chunks' fields before `choices` (id, object, created, model).
    head: dict[str, Any]
    want_logprobs: bool
    include_usage: bool
    streaming: bool
    _prefix: bytes = field(init=False)
    _suffix: bytes = field(init=False)
    #: Whether each sample's echo went out.
    _echoed: list[list[bool]] = field(init=False)

    def __post_init__(self) -> None:
        RawFramer.__post_init__(self)
        self._prefix = DATA_FIELD + _dumps(self.head)[:-1] + b',"choices":['
        self._suffix = (b'],"usage":null}' if self.include_usage else b"]}") + EVENT_END
        self._echoed = [[False] * self.n for _ in self.samples]

    def _frame(self, index: int, text: str, logprobs: Any, finish: str | None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self._prefix + _dumps(choice) + self._suffix

    def feed(self, item: tuple[int, EngineChunk]) -> bytes:
        i, chunk = item
        j = chunk.index
        sample = self.samples[i][j]
        text = sample.feed(chunk)
        if not self.streaming:
            return b""
        out = b""
        index = i * self.n + j
        if not self._echoed[i][j]:
            self._echoed[i][j] = True
            if self.echoes[i]:
                builder = self.builders[i][j]
                part = builder.add_prompt(self.prompt_ids[i]) if self.want_logprobs else None
                out += self._frame(index, self.echoes[i], part, None)
        logprobs = self.builders[i][j].add(chunk.logprobs or []) if self.want_logprobs else None
        if text or (logprobs and logprobs["tokens"]):
            out += self._frame(index, text, logprobs, None)
        if chunk.finished:
            out += self._frame(index, "", None, _completion_finish(sample))
        return out

    def tail(self) -> bytes:
        finish_context(self.ctx, self.batch)
        out = b""
        if self.include_usage:
            usage = _completion_usage(self.batch, self.samples)
            out += data_frame({**self.head, "choices": [], "usage": usage})
        return out + DONE
