"""Anthropic Messages API request schemas (Anthropic wire names).

Unknown and beta fields (`metadata`, `context_management`, `cache_control`, `container`, `mcp_servers`, ...)
are accepted and ignored, as Claude Code sends many of them. Content blocks stay plain dicts: the pipeline
validates them one by one and names the offending block in the error's message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from ...types.limits import (
    INT32_MAX,
    MAX_TOOLS,
    Schema,
    StopStrings,
    ToolDescriptionText,
    at_most,
    within_history_bound,
)
from ...types.request_base import OpenModel
from ...types.tool_names import ToolName


class MessageParam(OpenModel):
    #: "system" is the mid-conversation system message of the `mid-conversation-system` beta.
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


#: Content blocks that become prompt messages of their own.
_TOOL_BLOCK_TYPES = frozenset(
    {"tool_use", "tool_result", "server_tool_use", "mcp_tool_use", "mcp_tool_result"}
)


def _tool_blocks(message: dict[str, Any]) -> int:
    content = message.get("content")
    if not isinstance(content, list):
        return 0
    # Counted before validation: a block's type may be any JSON value, and is checked (a 400) later.
    return sum(
        1 for block in content if isinstance(block, dict) and str(block.get("type")) in _TOOL_BLOCK_TYPES
    )


class ToolParam(OpenModel):
    name: ToolName
    #: None or "custom" for client tools; Anthropic server tools carry a versioned type.
    type: str | None = None
    description: ToolDescriptionText = None
    input_schema: Schema = None


class ToolChoiceParam(OpenModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(OpenModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class OutputConfigParam(OpenModel):
    effort: str | None = None


class CountTokensRequest(OpenModel):
    model: str
    messages: Annotated[list[MessageParam], within_history_bound(_tool_blocks, "tool blocks")] = Field(
        min_length=1
    )
    system: str | list[dict[str, Any]] | None = None
    tools: Annotated[list[ToolParam] | None, at_most(MAX_TOOLS, "tools")] = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfigParam | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: StopStrings | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1, le=INT32_MAX)
