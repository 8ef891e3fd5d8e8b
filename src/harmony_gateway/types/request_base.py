"""What the request types of several surfaces share: unknown fields are accepted and ignored, as OpenAI's
API does, and the sampling fields Chat Completions and the legacy completions validate alike (OpenAI's,
plus the `top_k`, `min_p` and `repetition_penalty` of vLLM and SGLang)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .limits import Seed, TopK


class OpenModel(BaseModel):
    """A wire model that accepts unknown fields and ignores them."""

    model_config = ConfigDict(extra="allow")


class SamplingRequest(OpenModel):
    """The sampling fields of Chat Completions and completions requests (`prepare.request_sampling`)."""

    n: int = Field(default=1, ge=1, le=16)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: TopK | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: Seed | None = None
