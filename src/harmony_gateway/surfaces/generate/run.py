"""SGLang's native `POST /generate` over the raw-prompt stage (`pipeline/raw_prompt.py`).

The body: `{text, output_ids, meta_info: {id, prompt_tokens, completion_tokens, cached_tokens,
  finish_reason: {type: "stop", matched} | {type: "length", length} | {type: "abort"} | null,
  output_token_logprobs?: [[logprob, id, null]], output_top_logprobs?}}`; a list when there are several
  prompts or samples (prompt-major). Streams send `data: {...}` with the cumulative `text`, `output_ids` and
  logprobs of one sample (plus `index` when there are several), then `data: [DONE]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from ...engines.base import EngineChunk, SamplingOptions
from ...errors import InvalidRequest
from ...pipeline.context import GatewayState, RequestContext
from ...pipeline.drive import Generation, Planned
from ...pipeline.prepare import request_sampling
from ...pipeline.raw_prompt import (
    Prompt,
    RawFramer,
    RawSample,
    check_batch_size,
    decoder_factory,
    encode_prompt_off_loop,
    finish_context,
    new_batch,
    one_group,
    raw_prepared,
    raw_tokenizer,
    stop_list,
)
from ...routing.fleet import ModelGroup
from ...sse import DONE, data_frame
from ..chat.upstream import require_token_engine
from .types import GenerateRequest, SglangSamplingParams

_dumps = orjson.dumps


def _generate_prompts(request: GenerateRequest) -> tuple[list[Prompt], bool]:
    """(prompts, batched)."""
    if (request.text is None) == (request.input_ids is None):
        raise InvalidRequest("send exactly one of 'text' and 'input_ids'", param="text")
    if request.input_ids is not None:
        ids = request.input_ids
        batch = [item for item in ids if isinstance(item, list)]
        if batch:
            return list(batch), True
        return [[item for item in ids if isinstance(item, int)]], False
    if isinstance(request.text, list):
        return list(request.text), True
    return [request.text or ""], False


def _sglang_sampling(group: ModelGroup, params: SglangSamplingParams) -> SamplingOptions:
    sampling = request_sampling(group, params, seed=params.sampling_seed)
    sampling.min_new_tokens = params.min_new_tokens
    sampling.stop = stop_list(params.stop)
    sampling.stop_token_ids = list(params.stop_token_ids or ())
    sampling.ignore_eos = params.ignore_eos
    sampling.no_stop_trim = params.no_stop_trim
    sampling.json_schema = params.json_schema
    sampling.regex = params.regex
    sampling.structural_tag = params.structural_tag
    sampling.stream_interval = params.stream_interval  # the caller's own wins over --stream-interval
    constraints = (
        ("json_schema", params.json_schema),
        ("regex", params.regex),
        ("structural_tag", params.structural_tag),
    )
    kind = next((k for k, value in constraints if value is not None), None)
    sampling.constraint_param = f"sampling_params.{kind}" if kind else None
    return sampling


def _finish_reason(sample: RawSample) -> dict[str, Any] | None:
    if not sample.finished:
        return None
    if sample.finish_reason == "length":
        return {"type": "length", "length": sample.tokens}
    if sample.finish_reason == "abort":
        return {"type": "abort"}
    return {"type": "stop", "matched": sample.matched}


def _generate_item(
    sample: RawSample, rid: str, request: GenerateRequest, index: int | None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_reason(sample),
        "prompt_tokens": sample.prompt_tokens,
        "completion_tokens": sample.tokens,
        "cached_tokens": sample.cached_tokens,
    }
    if request.return_logprob:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id, None] for lp in sample.logprobs]
        if request.top_logprobs_num:
            meta["output_top_logprobs"] = [[[v, t, None] for t, v in lp.top] for lp in sample.logprobs]
    item: dict[str, Any] = {"text": sample.text, "output_ids": list(sample.ids), "meta_info": meta}
    if index is not None:
        item["index"] = index
    return item


async def plan_generate(state: GatewayState, request: GenerateRequest, ctx: RequestContext) -> Planned:
    group = one_group(state, request.model)
    ctx.model = group.name
    require_token_engine(group, "POST /generate", "use /v1/completions or /v1/chat/completions")
    prompts, batched = _generate_prompts(request)
    prompt_param = "input_ids" if request.input_ids is not None else "text"
    if not prompts:
        raise InvalidRequest("the batch is empty", param=prompt_param)
    check_batch_size(state, len(prompts), request.sampling_params.n, param=prompt_param)
    params = request.sampling_params
    tok = await raw_tokenizer(state, group)
    prepared = []
    for i, prompt in enumerate(prompts):
        param = ("input_ids" if request.input_ids is not None else "text") + (f"[{i}]" if batched else "")
        ids = await encode_prompt_off_loop(state, group, prompt, param=param, tok=tok)
        prepared.append(
            raw_prepared(
                state,
                group,
                ids,
                _sglang_sampling(group, params),
                requested_tokens=params.max_new_tokens,
                stream=request.stream,
                return_logprob=request.return_logprob,
                top_logprobs=request.top_logprobs_num,
                original_text=prompt if isinstance(prompt, str) else "",
                param=param,
            )
        )
    n = params.n
    new_decoder = decoder_factory(state, tok, params.skip_special_tokens)
    samples = [[RawSample(new_decoder()) for _ in range(n)] for _ in prompts]
    opened = new_batch(state, ctx, prepared, stream=request.stream)
    several = batched or n > 1
    framer = GenerateFramer(ctx, opened, samples, request, several)

    async def body() -> dict[str, Any] | list[dict[str, Any]]:
        finish_context(ctx, opened)
        items = [
            _generate_item(samples[i][j], opened.children[i].request_id, request, None)
            for i in range(len(prompts))
            for j in range(n)
        ]
        return items if several else items[0]

    return Generation(opened.source, framer, body=None if request.stream else body)


@dataclass(slots=True, eq=False)
class GenerateFramer(RawFramer):
    """`/generate` output: every sample's cumulative state per engine chunk (streamed as `data:`
    events), `[DONE]` at the end; a failure is the OpenAI-style error event."""

    request: GenerateRequest
    #: Several prompts or samples: items carry their `index` and the body is a list.
    several: bool

    def feed(self, item: tuple[int, EngineChunk]) -> bytes:
        i, chunk = item
        sample = self.samples[i][chunk.index]
        sample.feed(chunk)
        if not self.request.stream or not (chunk.token_ids or chunk.finished):
            return b""
        index = i * self.n + chunk.index if self.several else None
        out = _generate_item(sample, self.batch.children[i].request_id, self.request, index)
        return data_frame(out)

    def tail(self) -> bytes:
        finish_context(self.ctx, self.batch)
        return DONE


# -- /v1/completions ----------------------------------------------------------------------------------
