"""Request schema of SGLang's native `/generate` (SGLang's field names). Unknown fields are accepted and
ignored."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ...types.limits import MAX_STOP_TOKEN_IDS, Seed, StopParam, TokenCount, TokenId, TopK, at_most
from ...types.request_base import OpenModel

#: SGLang's default for `max_new_tokens`.
SGLANG_MAX_NEW_TOKENS = 128


class SglangSamplingParams(OpenModel):
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: TopK | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = Field(default=None, gt=0)
    max_new_tokens: int | None = Field(default=SGLANG_MAX_NEW_TOKENS, ge=0)
    min_new_tokens: TokenCount = 0
    stop: StopParam | None = None
    stop_token_ids: Annotated[list[TokenId] | None, at_most(MAX_STOP_TOKEN_IDS, "stop token ids")] = None
    n: int = Field(default=1, ge=1, le=16)
    ignore_eos: bool = False
    #: Unset: false for Harmony models (raw Harmony text is what RL and evaluation users need), true for
    #: other models (SGLang's default).
    skip_special_tokens: bool | None = None
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    structural_tag: str | None = None
    sampling_seed: Seed | None = None
    #: Tokens per streamed message, as SGLang's own field; unset: the gateway's --stream-interval.
    stream_interval: int | None = Field(default=None, ge=1, le=1024)


class GenerateRequest(OpenModel):
    #: Not an SGLang field: picks the model when the gateway serves several (else the only one).
    model: str | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SglangSamplingParams = Field(default_factory=SglangSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    logprob_start_len: int = -1
