"""Request schema of OpenAI's legacy `/v1/completions`. Unknown fields are accepted and ignored."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ...types.limits import MAX_STOP_TOKEN_IDS, Seed, StopParam, TokenId, TopK, at_most

#: OpenAI's (and vLLM's) default for completions `max_tokens`.
COMPLETIONS_MAX_TOKENS = 16


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool = False


class CompletionRequest(_Open):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=COMPLETIONS_MAX_TOKENS, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: TopK | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    n: int = Field(default=1, ge=1, le=16)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    stop: StopParam | None = None
    stop_token_ids: Annotated[list[TokenId] | None, at_most(MAX_STOP_TOKEN_IDS, "stop token ids")] = None
    seed: Seed | None = None
    suffix: str | None = None
    ignore_eos: bool = False
    #: vLLM extension. Unset: false for Harmony models (the raw Harmony text), true for other models.
    skip_special_tokens: bool | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
