"""The raw-prompt stage `/generate` and `/v1/completions` share: prompts in, raw output out.

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
`<id>-<prompt index>` when there are several prompts."""

from __future__ import annotations

import codecs
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import quicktok

from ..engines.base import EngineChunk, SamplingOptions, take_counts
from ..errors import InvalidRequest
from ..harmony.encoding import ASSISTANT_STOP_IDS, FIRST_SPECIAL_ID, VOCAB_SIZE, client_text
from ..routing.fleet import ModelGroup
from ..types.limits import INT32_MAX
from .batch import Batch
from .context import GatewayState, PreparedRequest, RequestContext
from .detokenize import IncrementalDetokenizer
from .drive import NothingToSettle, open_generation
from .prepare import (
    LOOP_ENCODE_CHARS,
    SELECTION_TEXT_CHARS,
    token_budget,
)
from .tokenizer import ModelTokenizer
from .tokenizer_cache import model_tokenizer


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
#: One prompt of a raw route: text, or token ids.
Prompt = str | list[int]


def one_group(state: GatewayState, model: str | None) -> ModelGroup:
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
    state: GatewayState, group: ModelGroup, prompt: Prompt, *, param: str, tok: ModelTokenizer | None = None
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
    state: GatewayState, group: ModelGroup, prompt: Prompt, *, param: str, tok: ModelTokenizer | None = None
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


def stop_list(stop: str | list[str] | None) -> list[str]:
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


def new_batch(
    state: GatewayState, ctx: RequestContext, prepared: list[PreparedRequest], *, stream: bool
) -> Batch:
    """The prompts' engine requests, dispatched (a bounded number at once) by `Batch.source`, which
    waits for the first wave's first chunks."""

    async def opener(
        state: GatewayState, item: PreparedRequest, child: RequestContext
    ) -> AsyncIterator[EngineChunk]:
        return await open_generation(state, item, child, stream=stream)

    batch = Batch(state, ctx, prepared, opener, concurrency=state.settings.batch_concurrency)
    ctx.cleanups.append(batch.aclose)  # also when the stream never starts (client gone early)
    return batch


def finish_context(ctx: RequestContext, batch: Batch) -> None:
    ctx.prompt_tokens = sum(len(p.input_ids) for p in batch.prepared)
    if ctx.worker is None:
        ctx.worker = batch.children[0].worker


# -- framing the samples --------------------------------------------------------------------------------
@dataclass(slots=True, eq=False)
class RawFramer(NothingToSettle):
    """What the `/generate` and `/v1/completions` framers share: the samples of a batch, stop strings left
    to the engine, and the error event of the request's wire."""

    ctx: RequestContext
    batch: Batch
    #: Each prompt's samples (`n` of them), prompt-major.
    samples: list[list[RawSample]]
    n: int = field(init=False)

    def __post_init__(self) -> None:
        self.n = len(self.samples[0])

    def stopped(self) -> bool:
        return False  # stop strings are the engine's on these routes

    def error(self, exc: BaseException) -> bytes:
        return self.ctx.error_frame(exc)

    def completion_tokens(self) -> int:
        return sum(s.tokens for group in self.samples for s in group)
