"""Chat Completions request schema (OpenAI wire names). Unknown fields are accepted and ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ...types.limits import (
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    Schema,
    StopParam,
    TokenId,
    ToolDescriptionText,
    at_most,
    within_history_bound,
)
from ...types.request_base import OpenModel, SamplingRequest
from ...types.tool_names import ToolName


class FunctionCall(OpenModel):
    name: str
    arguments: str | None = None


class ToolCall(OpenModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(OpenModel):
    name: ToolName
    description: ToolDescriptionText = None
    parameters: Schema = None
    strict: bool | None = None


class ChatTool(OpenModel):
    type: str
    function: FunctionDefinition | None = None


def _tool_calls(message: dict[str, Any]) -> int:
    calls = message.get("tool_calls")
    return len(calls) if isinstance(calls, list) else 0


class StreamOptions(OpenModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatCompletionRequest(SamplingRequest):
    model: str
    messages: Annotated[list[ChatMessage], within_history_bound(_tool_calls, "tool calls")] = Field(
        min_length=1
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: Annotated[list[ChatTool] | None, at_most(MAX_TOOLS, "tools")] = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: StopParam | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[TokenId] | None, at_most(MAX_STOP_TOKEN_IDS, "stop token ids")] = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    #: Extension: a cap on analysis tokens, after which the gateway moves the model to its final answer.
    max_reasoning_tokens: int | None = Field(default=None, ge=1)
