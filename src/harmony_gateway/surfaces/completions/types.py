"""Request schema of OpenAI's legacy `/v1/completions`. Unknown fields are accepted and ignored."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from ...types.limits import MAX_STOP_TOKEN_IDS, StopParam, TokenId, at_most
from ...types.request_base import OpenModel, SamplingRequest

#: OpenAI's (and vLLM's) default for completions `max_tokens`.
COMPLETIONS_MAX_TOKENS = 16


class StreamOptions(OpenModel):
    include_usage: bool = False


class CompletionRequest(SamplingRequest):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=COMPLETIONS_MAX_TOKENS, ge=0)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    stop: StopParam | None = None
    stop_token_ids: Annotated[list[TokenId] | None, at_most(MAX_STOP_TOKEN_IDS, "stop token ids")] = None
    suffix: str | None = None
    ignore_eos: bool = False
    #: vLLM extension. Unset: false for Harmony models (the raw Harmony text), true for other models.
    skip_special_tokens: bool | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
