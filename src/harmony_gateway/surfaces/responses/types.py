"""Responses API request schema (OpenAI wire names). Unknown fields (Codex sends `client_metadata`,
others `service_tier`, ...) are accepted and ignored; invalid values are 400 with `param`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from ...types.limits import (
    MAX_INSTRUCTIONS_CHARS,
    MAX_ITEMS_PER_CONVERSATION_CALL,
    MAX_MESSAGES,
    MAX_TOOLS,
    Metadata,
    at_most,
)
from ...types.request_base import OpenModel
from ...types.tool_names import ResponsesTool


class ReasoningConfig(OpenModel):
    effort: str | None = None
    summary: str | None = None
    #: Extension: a cap on analysis tokens, after which the model moves to its final answer.
    max_tokens: int | None = Field(default=None, ge=1)


class ResponsesRequest(OpenModel):
    model: str
    input: Annotated[str | list[dict[str, Any]], at_most(MAX_MESSAGES, "input items")] = ""
    instructions: str | None = Field(default=None, max_length=MAX_INSTRUCTIONS_CHARS)
    tools: Annotated[list[ResponsesTool] | None, at_most(MAX_TOOLS, "tools")] = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    max_tool_calls: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    stream: bool = False
    background: bool = False
    metadata: Metadata = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    #: OpenAI's stable id of an end user, echoed (its schema caps it at 64 characters).
    safety_identifier: str | None = Field(default=None, max_length=64)
    #: Routes requests that share a prefix together (`pipeline.prepare.prompt_cache_key_of`); echoed.
    prompt_cache_key: str | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    #: `[{"type": "compaction", "compact_threshold": N}]`: compact the conversation first when its prompt
    #: passes N tokens (surfaces/responses/compaction.py).
    context_management: list[Any] | None = None

    def conversation_id(self) -> str | None:
        if self.conversation is None:
            return None
        if isinstance(self.conversation, str):
            return self.conversation
        value = self.conversation.get("id")
        return value if isinstance(value, str) else None


class ConversationCreate(OpenModel):
    items: Annotated[list[dict[str, Any]] | None, at_most(MAX_ITEMS_PER_CONVERSATION_CALL, "items")] = None
    metadata: Metadata = None


class ConversationUpdate(OpenModel):
    metadata: Metadata


class ConversationItemsCreate(OpenModel):
    items: Annotated[list[dict[str, Any]], at_most(MAX_ITEMS_PER_CONVERSATION_CALL, "items")] = Field(
        min_length=1
    )


class CompactRequest(OpenModel):
    """`POST /v1/responses/compact` (OpenAI's `CompactResponseMethodPublicBody`). `prompt_cache_retention`,
    `prompt_cache_options` and `service_tier` are accepted and ignored; `model` may be null when the
    gateway serves one Harmony model."""

    model: str | None
    input: Annotated[str | list[dict[str, Any]] | None, at_most(MAX_MESSAGES, "input items")] = None
    previous_response_id: str | None = None
    instructions: str | None = Field(default=None, max_length=MAX_INSTRUCTIONS_CHARS)
    prompt_cache_key: str | None = None


class InputTokensRequest(OpenModel):
    """`POST /v1/responses/input_tokens` (OpenAI's `TokenCountsBody`): what a `POST /v1/responses` with
    these fields would send the model. `personality` is accepted and ignored (gpt-oss has none)."""

    model: str | None = None
    input: Annotated[str | list[dict[str, Any]] | None, at_most(MAX_MESSAGES, "input items")] = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    instructions: str | None = Field(default=None, max_length=MAX_INSTRUCTIONS_CHARS)
    tools: Annotated[list[ResponsesTool] | None, at_most(MAX_TOOLS, "tools")] = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
