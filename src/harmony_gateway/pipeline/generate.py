"""Raw prompts in, raw output out: SGLang's native `/generate` and OpenAI's legacy `/v1/completions`.

For a Harmony model no conversation is built: token ids pass through unchanged, a text prompt is encoded with
the Harmony encoding as raw text (special-token text such as `<|start|>` becomes the special token), and the
assistant stop ids {200002 `<|return|>`, 200012 `<|call|>`} are added to the request's `stop_token_ids`.
Output text is the decoded output ids *including* special tokens (`<|channel|>analysis<|message|>...`) and a
stop token the engine returned, so text and `output_ids` describe the same sequence; `skip_special_tokens`
drops special tokens from the text. Client `stop` strings go to the engine as they are (they match all
output, as these routes have no notion of answer text).

Other models use their own tokenizer (`pipeline/tokenizer.py`): a text prompt is encoded with it (special
tokens added as its post-processor says, as SGLang and vLLM do), token ids pass through, and output is
detokenized incrementally (`IncrementalDetokenizer`: no delta ever carries half a UTF-8 character);
`skip_special_tokens` defaults to true for them, as in SGLang. Models served by an HTTP upstream have no
token-level interface: `/generate` is a 400 naming the model, and `/v1/completions` is forwarded to the
upstream's `/v1/completions` one prompt at a time (the upstream's text passes through; no logprobs).

Each prompt (and batch entry) is one engine request with `n` samples, dispatched with the chat stages
(`drive.open_generation`, so failures before any output are HTTP errors), under its own request id
`<id>-<prompt index>` when there are several prompts. Formats:

- `/generate`: `{text, output_ids, meta_info: {id, prompt_tokens, completion_tokens, cached_tokens,
  finish_reason: {type: "stop", matched} | {type: "length", length} | {type: "abort"} | null,
  output_token_logprobs?: [[logprob, id, null]], output_top_logprobs?}}`; a list when there are several
  prompts or samples (prompt-major). Streams send `data: {...}` with the cumulative `text`, `output_ids` and
  logprobs of one sample (plus `index` when there are several), then `data: [DONE]`.
- `/v1/completions`: `text_completion` objects; choice index = prompt index * n + sample; `echo` prepends
  the prompt text; `logprobs` follows the legacy shape (`tokens`, `token_logprobs`, `top_logprobs`,
  `text_offset`); echoed prompt tokens have null logprobs (prompt logprobs are not computed).
"""

from __future__ import annotations

import codecs
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import orjson

from ..engines.base import EngineChunk, SamplingOptions, take_counts
from ..errors import InvalidRequest
from ..harmony.encoding import ASSISTANT_STOP_IDS, FIRST_SPECIAL_ID, VOCAB_SIZE, client_text
from ..routing.fleet import ModelGroup
from ..types.generate import CompletionRequest, GenerateRequest, SglangSamplingParams
from ..types.limits import INT32_MAX
from .batch import Batch
from .context import GatewayState, PreparedRequest, RequestContext
from .detokenize import IncrementalDetokenizer
from .drive import NothingToSettle, collect, drive, open_generation
from .prepare import LOOP_ENCODE_CHARS, SELECTION_TEXT_CHARS, request_sampling, sampling_options, token_budget
from .sse import DONE
from .text_upstream import is_text_group, require_token_engine
from .tokenizer import ModelTokenizer, model_tokenizer

_dumps = orjson.dumps


# -- text of token ids --------------------------------------------------------------------------------
class TokenTextDecoder:
    """Raw text of o200k/Harmony token ids, incrementally: ordinary tokens by their bytes (a UTF-8 sequence
    split over tokens is held back until complete), special tokens by their names."""

    __slots__ = ("_bytes_of", "_special", "_skip_special", "_utf8")

    def __init__(self, state: GatewayState, *, skip_special_tokens: bool = False) -> None:
        self._bytes_of = _token_bytes()
        self._special = _special_text(state)
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_ids: Sequence[int]) -> str:
        pieces = []
        for token in token_ids:
            if token >= FIRST_SPECIAL_ID:
                pieces.append(self._utf8.decode(b"", final=True))
                self._utf8.reset()
                if not self._skip_special:
                    pieces.append(self._special(token))
            else:
                pieces.append(self._utf8.decode(self._bytes_of(token)))
        return "".join(pieces)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    def token_text(self, token: int) -> str:
        """One token on its own, for logprob entries (a partial UTF-8 sequence shows as U+FFFD)."""
        if token >= FIRST_SPECIAL_ID:
            return self._special(token)
        return self._bytes_of(token).decode("utf-8", "replace")


class ModelTextDecoder:
    """Text of a non-Harmony model's token ids with the model's own tokenizer, incrementally; the same
    interface as `TokenTextDecoder`."""

    __slots__ = ("_detok", "_tok")

    def __init__(self, tok: ModelTokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tok
        self._detok = IncrementalDetokenizer(tok.tokenizer, skip_special_tokens=skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        return self._detok.push(token_ids)

    def flush(self) -> str:
        return self._detok.flush()

    def token_text(self, token: int) -> str:
        return self._tok.token_text(token)


Decoder = TokenTextDecoder | ModelTextDecoder


def decoder_factory(
    state: GatewayState, tok: ModelTokenizer | None, skip_special_tokens: bool | None
) -> Callable[[], Decoder]:
    """New decoders for one request: the model's tokenizer when given, else the Harmony vocabulary.
    `skip_special_tokens` unset: false for Harmony text, true for other models."""
    if tok is not None:
        skip = True if skip_special_tokens is None else skip_special_tokens
        return functools.partial(ModelTextDecoder, tok, skip_special_tokens=skip)
    return functools.partial(TokenTextDecoder, state, skip_special_tokens=bool(skip_special_tokens))


def decode_all(decoder: Decoder, token_ids: Sequence[int]) -> str:
    return decoder.push(token_ids) + decoder.flush()


@functools.cache
def _token_bytes() -> Callable[[int], bytes]:
    import quicktok

    return quicktok.get_encoding("o200k_base").decode_single_token_bytes  # type: ignore[no-any-return]


def _special_text(state: GatewayState) -> Callable[[int], str]:
    cache: dict[int, str] = {}
    decode = state.encoding.decode

    def special(token: int) -> str:
        text = cache.get(token)
        if text is None:
            try:
                text = decode([token])
            except Exception:  # an id outside the vocabulary: nothing to show
                text = ""
            cache[token] = text
        return text

    return special


# -- preparing a raw prompt -----------------------------------------------------------------------------
def _one_group(state: GatewayState, model: str | None) -> ModelGroup:
    if model:
        return state.fleet.group(model)
    groups = list(state.fleet.groups.values())
    if len(groups) == 1:
        return groups[0]
    if not groups:
        return state.fleet.group("")  # raises: nothing is served (yet)
    raise InvalidRequest("several models are served: name one in 'model'", param="model")


async def raw_tokenizer(state: GatewayState, group: ModelGroup) -> ModelTokenizer | None:
    """The tokenizer raw routes use: None for Harmony models (the o200k vocabulary), the model's own
    otherwise (raises UpstreamError when none can be loaded)."""
    return None if group.harmony else await model_tokenizer(state, group)


def encode_prompt(
    state: GatewayState,
    group: ModelGroup,
    prompt: str | list[int],
    *,
    param: str,
    tok: ModelTokenizer | None = None,
) -> list[int]:
    if not isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("a token prompt must not be empty", param=param)
        # Other models' engines check their own vocabulary; an id must still fit the engine wire.
        limit = VOCAB_SIZE if group.harmony else INT32_MAX + 1
        bad = next((t for t in prompt if not 0 <= t < limit), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0 to {limit - 1})", param=param)
        return prompt
    if not prompt:
        raise InvalidRequest("the prompt must not be empty", param=param)
    if not group.harmony:
        if tok is None:
            raise InvalidRequest(
                f"text prompts need the model's tokenizer; send token ids for {group.name!r}", param=param
            )
        ids: list[int] = tok.tokenizer.encode(prompt, add_special_tokens=True).ids
        return ids
    with client_text(param):
        return state.renderer.encode_with_special_tokens(prompt)


async def encode_prompt_off_loop(
    state: GatewayState,
    group: ModelGroup,
    prompt: str | list[int],
    *,
    param: str,
    tok: ModelTokenizer | None = None,
) -> list[int]:
    """`encode_prompt`, in a thread when the prompt is long enough to hold the event loop."""
    if len(prompt) <= LOOP_ENCODE_CHARS:
        return encode_prompt(state, group, prompt, param=param, tok=tok)
    return await anyio.to_thread.run_sync(
        functools.partial(encode_prompt, state, group, prompt, param=param, tok=tok)
    )


def raw_prepared(
    state: GatewayState,
    group: ModelGroup,
    input_ids: list[int],
    sampling: SamplingOptions,
    *,
    requested_tokens: int | None,
    stream: bool,
    return_logprob: bool,
    top_logprobs: int,
    original_text: str,
    param: str,
) -> PreparedRequest:
    sampling.max_new_tokens = token_budget(group, len(input_ids), requested_tokens, param=param)
    if group.harmony:
        sampling.stop_token_ids = [
            *sampling.stop_token_ids,
            *(t for t in ASSISTANT_STOP_IDS if t not in sampling.stop_token_ids),
        ]
    return PreparedRequest(
        group=group,
        input_ids=input_ids,
        sampling=sampling,
        selection_text=original_text[:SELECTION_TEXT_CHARS],
        stream=stream,
        n=sampling.n,
        harmony=group.harmony,
        return_logprob=return_logprob,
        top_logprobs=top_logprobs,
        original_text=original_text,
    )


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# -- one sample's output ----------------------------------------------------------------------------------
class RawSample:
    """The output of one sample: ids, text, logprobs, finish and counts. Fed with engine chunks in order:
    token ids (decoded with `decoder`) or, from an HTTP upstream, text as it is."""

    __slots__ = (
        "cached_tokens",
        "completion_tokens",
        "decoder",
        "finish_reason",
        "finished",
        "ids",
        "logprobs",
        "matched",
        "prompt_tokens",
        "text_parts",
    )

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.ids: list[int] = []
        self.text_parts: list[str] = []
        self.logprobs: list[Any] = []
        self.finish_reason: str | None = None
        self.matched: int | str | None = None
        self.finished = False
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0

    def feed(self, chunk: EngineChunk) -> str:
        """Returns the new text."""
        self.ids.extend(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        take_counts(self, chunk)
        if chunk.text is not None:
            text = chunk.text
        else:
            text = self.decoder.push(chunk.token_ids) if chunk.token_ids else ""
        if chunk.finished:
            self.finished = True
            self.finish_reason = chunk.finish_reason or "stop"
            self.matched = (
                chunk.matched_stop_token if chunk.matched_stop_token is not None else chunk.matched_stop_str
            )
            text += self.decoder.flush()
        if text:
            self.text_parts.append(text)
        return text

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def tokens(self) -> int:
        return self.completion_tokens or len(self.ids)


# -- dispatching several prompts ------------------------------------------------------------------------
def check_batch_size(state: GatewayState, prompts: int, n: int, *, param: str) -> None:
    """A batch asks for at most `max_batch_size` samples (prompts × n): 400 naming the prompt param."""
    limit = state.settings.max_batch_size
    if prompts * n > limit:
        raise InvalidRequest(
            f"a batch may ask for at most {limit} samples (prompts × n); this one asks for {prompts * n}",
            param=param,
        )


async def _open_batch(
    state: GatewayState, ctx: RequestContext, prepared: list[PreparedRequest], *, stream: bool
) -> Batch:
    """Dispatch the prompts (a bounded number at once) and wait for the first wave's first chunks."""

    async def opener(
        state: GatewayState, item: PreparedRequest, child: RequestContext
    ) -> AsyncIterator[EngineChunk]:
        return await open_generation(state, item, child, stream=stream)

    batch = Batch(state, ctx, prepared, opener, concurrency=state.settings.batch_concurrency)
    await batch.open()
    ctx.cleanups.append(batch.aclose)  # also when the stream never starts (client gone early)
    return batch


def _finish_ctx(ctx: RequestContext, batch: Batch, samples: list[list[RawSample]]) -> None:
    ctx.prompt_tokens = sum(len(p.input_ids) for p in batch.prepared)
    ctx.completion_tokens = sum(s.tokens for group in samples for s in group)
    if ctx.worker is None:
        ctx.worker = batch.children[0].worker


# -- /generate ------------------------------------------------------------------------------------------
def _generate_prompts(request: GenerateRequest) -> tuple[list[str | list[int]], bool]:
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
    sampling = sampling_options(
        group,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        seed=params.sampling_seed,
        n=params.n,
    )
    sampling.min_new_tokens = params.min_new_tokens
    sampling.stop = _stops(params.stop)
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


async def run_generate(
    state: GatewayState, request: GenerateRequest, ctx: RequestContext
) -> dict[str, Any] | list[dict[str, Any]] | AsyncGenerator[bytes, None]:
    group = _one_group(state, request.model)
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
    opened = await _open_batch(state, ctx, prepared, stream=request.stream)
    several = batched or n > 1
    framer = GenerateFramer(ctx, opened, samples, request, several)
    if not request.stream:
        await collect(ctx, opened.chunks(), framer)
        _finish_ctx(ctx, opened, samples)
        items = [
            _generate_item(samples[i][j], opened.children[i].request_id, request, None)
            for i in range(len(prompts))
            for j in range(n)
        ]
        return items if several else items[0]
    return drive(ctx, opened.chunks(), framer)


class GenerateFramer(NothingToSettle):
    """`/generate` output: every sample's cumulative state per engine chunk (streamed as `data:`
    events), `[DONE]` at the end; a failure is the OpenAI-style error event."""

    __slots__ = ("_batch", "_ctx", "_n", "_request", "_samples", "_several")

    def __init__(
        self,
        ctx: RequestContext,
        batch: Batch,
        samples: list[list[RawSample]],
        request: GenerateRequest,
        several: bool,
    ) -> None:
        self._ctx = ctx
        self._batch = batch
        self._samples = samples
        self._request = request
        self._several = several
        self._n = len(samples[0])

    def feed(self, item: tuple[int, EngineChunk]) -> bytes:
        i, chunk = item
        sample = self._samples[i][chunk.index]
        sample.feed(chunk)
        if not self._request.stream or not (chunk.token_ids or chunk.finished):
            return b""
        index = i * self._n + chunk.index if self._several else None
        out = _generate_item(sample, self._batch.children[i].request_id, self._request, index)
        return b"data: " + _dumps(out) + b"\n\n"

    def stopped(self) -> bool:
        return False  # stop strings are the engine's on these routes

    def tail(self) -> bytes:
        _finish_ctx(self._ctx, self._batch, self._samples)
        return DONE

    def error(self, exc: BaseException) -> bytes:
        return self._ctx.error_frame(exc)

    def completion_tokens(self) -> int:
        return sum(s.tokens for group in self._samples for s in group)


# -- /v1/completions ----------------------------------------------------------------------------------
def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
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
    request: CompletionRequest, prompt: str | list[int], prepared: PreparedRequest
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


async def run_completions(
    state: GatewayState, request: CompletionRequest, ctx: RequestContext
) -> dict[str, Any] | AsyncGenerator[bytes, None]:
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
        sampling = request_sampling(group, request)
        sampling.stop = _stops(request.stop)
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
    opened = await _open_batch(state, ctx, prepared, stream=request.stream)
    completion_id = "cmpl-" + ctx.request_id
    created = int(time.time())
    head = {"id": completion_id, "object": "text_completion", "created": created, "model": group.name}
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    framer = CompletionsFramer(
        ctx, opened, samples, builders, echoes, prompt_ids, head, logprobs is not None, include_usage
    )
    if not request.stream:
        await collect(ctx, opened.chunks(), framer)
        _finish_ctx(ctx, opened, samples)
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
    framer.streaming = True
    return drive(ctx, opened.chunks(), framer)


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


class CompletionsFramer(NothingToSettle):
    """`text_completion` chunks: the echoed prompt before a choice's first text, its text (and legacy
    logprobs) per engine chunk, a finish chunk as it ends, then usage when asked and `[DONE]`; a
    failure is the error event. Not streaming (`streaming` false) it only feeds the samples."""

    __slots__ = (
        "_batch",
        "_builders",
        "_ctx",
        "_echoed",
        "_echoes",
        "_head",
        "_include_usage",
        "_n",
        "_prefix",
        "_prompt_ids",
        "_samples",
        "_suffix",
        "_want_logprobs",
        "streaming",
    )

    def __init__(
        self,
        ctx: RequestContext,
        batch: Batch,
        samples: list[list[RawSample]],
        builders: list[list[_LogprobBuilder]],
        echoes: list[str],
        prompt_ids: list[list[int]],
        head: dict[str, Any],
        want_logprobs: bool,
        include_usage: bool,
    ) -> None:
        self._ctx = ctx
        self._batch = batch
        self._samples = samples
        self._builders = builders
        self._echoes = echoes
        self._prompt_ids = prompt_ids
        self._head = head
        self._want_logprobs = want_logprobs
        self._include_usage = include_usage
        self._n = len(samples[0])
        self._prefix = b"data: " + _dumps(head)[:-1] + b',"choices":['
        self._suffix = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
        self._echoed = [[False] * self._n for _ in samples]
        self.streaming = False

    def _frame(self, index: int, text: str, logprobs: Any, finish: str | None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self._prefix + _dumps(choice) + self._suffix

    def feed(self, item: tuple[int, EngineChunk]) -> bytes:
        i, chunk = item
        j = chunk.index
        sample = self._samples[i][j]
        text = sample.feed(chunk)
        if not self.streaming:
            return b""
        out = b""
        index = i * self._n + j
        if not self._echoed[i][j]:
            self._echoed[i][j] = True
            if self._echoes[i]:
                builder = self._builders[i][j]
                part = builder.add_prompt(self._prompt_ids[i]) if self._want_logprobs else None
                out += self._frame(index, self._echoes[i], part, None)
        logprobs = self._builders[i][j].add(chunk.logprobs or []) if self._want_logprobs else None
        if text or (logprobs and logprobs["tokens"]):
            out += self._frame(index, text, logprobs, None)
        if chunk.finished:
            out += self._frame(index, "", None, _completion_finish(sample))
        return out

    def stopped(self) -> bool:
        return False  # stop strings are the engine's on these routes

    def tail(self) -> bytes:
        _finish_ctx(self._ctx, self._batch, self._samples)
        out = b""
        if self._include_usage:
            usage = _completion_usage(self._batch, self._samples)
            out += b"data: " + _dumps({**self._head, "choices": [], "usage": usage}) + b"\n\n"
        return out + DONE

    def error(self, exc: BaseException) -> bytes:
        return self._ctx.error_frame(exc)

    def completion_tokens(self) -> int:
        return sum(s.tokens for group in self._samples for s in group)


__all__ = [
    "ModelTextDecoder",
    "RawSample",
    "TokenTextDecoder",
    "completions_passthrough_body",
    "decode_all",
    "decoder_factory",
    "encode_prompt",
    "raw_prepared",
    "raw_tokenizer",
    "run_completions",
    "run_generate",
]
