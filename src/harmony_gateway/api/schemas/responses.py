"""Responses API request schema (OpenAI wire names). Unknown fields (Codex sends `client_metadata`,
agents send `prompt_cache_key`, ...) are accepted and ignored; invalid values are 400 with `param`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ReasoningConfig(_Open):
    effort: str | None = None
    summary: str | None = None
    #: Extension: a cap on analysis tokens, after which the model moves to its final answer.
    max_tokens: int | None = Field(default=None, ge=1)


class ResponsesRequest(_Open):
    model: str
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    max_tool_calls: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    stream: bool = False
    background: bool = False
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def conversation_id(self) -> str | None:
        if self.conversation is None:
            return None
        if isinstance(self.conversation, str):
            return self.conversation
        value = self.conversation.get("id")
        return value if isinstance(value, str) else None


class ConversationCreate(_Open):
    items: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


class ConversationUpdate(_Open):
    metadata: dict[str, Any]


class ConversationItemsCreate(_Open):
    items: list[dict[str, Any]] = Field(min_length=1, max_length=20)
