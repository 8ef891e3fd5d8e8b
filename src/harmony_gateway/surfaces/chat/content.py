"""What every Chat Completions prepare path (Harmony, chat template, HTTP passthrough) reads from a
request the same way: the text of content parts, the declared function tools, and the newest user text
that routing keys on."""

from __future__ import annotations

from typing import Any

from ...errors import InvalidRequest
from ...harmony.messages import FunctionTool, dedupe_function_tools
from ...pipeline.prepare import newest_user_text
from .types import ChatCompletionRequest


def text_of(content: str | list[dict[str, Any]] | None, *, param: str, allow_refusal: bool = False) -> str:
    """Concatenate text parts; non-text parts are 400 (gpt-oss is text-only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text") or (allow_refusal and kind == "refusal"):
            value = part.get("text", part.get("refusal", ""))
            if not isinstance(value, str):
                raise InvalidRequest("text parts must carry a string 'text'", param=f"{param}[{j}].text")
            pieces.append(value)
        else:
            raise InvalidRequest(
                f"content part type {kind!r} is not supported: this model accepts text only",
                param=f"{param}[{j}]",
            )
    return "".join(pieces)


def chat_function_tools(request: ChatCompletionRequest) -> list[FunctionTool]:
    tools: list[FunctionTool] = []
    for i, tool in enumerate(request.tools or []):
        if tool.type != "function" or tool.function is None:
            raise InvalidRequest(
                f"tool type {tool.type!r} is not supported in chat completions; use 'function'",
                param=f"tools[{i}].type",
            )
        fn = tool.function
        tools.append(FunctionTool(fn.name, fn.description or "", fn.parameters, f"tools[{i}]"))
    return dedupe_function_tools(tools)


def selection_text(request: ChatCompletionRequest) -> str:
    return newest_user_text((message.role, message.content) for message in reversed(request.messages))
