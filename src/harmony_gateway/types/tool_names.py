"""Tool names as OpenAI and Anthropic accept them: 1 to 64 ASCII letters, digits, underscores or dashes.

A declared name is copied into the prompt (Harmony's `to=functions.NAME`, a chat template's tool list)
and into the structural tag sent to engines, so every request type checks it while the body is
validated: `ToolName` for typed fields, `ResponsesTool` for the Responses API's tools (kept as dicts),
a 400 naming the field either way. `is_tool_name` is the same rule for code that holds a name already.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field, ValidationError

#: OpenAI's rule for function names (`FunctionDefinition.name`), Anthropic's for tool names.
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: Responses tool types that declare a name the model calls (a namespace's is the calls' prefix).
NAMED_RESPONSES_TOOLS = frozenset({"function", "custom", "namespace"})


def is_tool_name(name: object) -> bool:
    return isinstance(name, str) and _TOOL_NAME.fullmatch(name) is not None


def check_tool_name(name: str) -> str:
    """`name`, or ValueError saying the rule (the offending name shortened: it may be a megabyte)."""
    if not is_tool_name(name):
        shown = name if len(name) <= 80 else f"{name[:80]}..."
        raise ValueError(f"tool names are 1 to 64 letters, digits, underscores or dashes, not {shown!r}")
    return name


ToolName = Annotated[
    str,
    AfterValidator(check_tool_name),
    Field(json_schema_extra={"pattern": TOOL_NAME_PATTERN, "minLength": 1, "maxLength": 64}),
]


def _name_errors(tool: dict[str, Any], loc: tuple[str | int, ...]) -> list[Any]:
    """Line errors for a Responses tool's name and, for a namespace, its members' names. A name that
    is missing or not a string is left to the pipeline, which says what the tool kind needs."""
    errors: list[Any] = []
    kind, name = tool.get("type"), tool.get("name")
    if not isinstance(kind, str):
        return errors  # the pipeline names a missing or malformed type
    if kind in NAMED_RESPONSES_TOOLS and isinstance(name, str):
        try:
            check_tool_name(name)
        except ValueError as exc:
            errors.append(
                {"type": "value_error", "loc": (*loc, "name"), "input": name, "ctx": {"error": exc}}
            )
    members = tool.get("tools")
    if kind == "namespace" and isinstance(members, list):
        for j, member in enumerate(members):
            if isinstance(member, dict):
                errors += _name_errors(member, (*loc, "tools", j))
    return errors


def _check_responses_tool(tool: dict[str, Any]) -> dict[str, Any]:
    errors = _name_errors(tool, ())
    if errors:
        # Raised as a ValidationError so pydantic prefixes the tool's place: `tools[2].tools[0].name`.
        raise ValidationError.from_exception_data("tool", errors)
    return tool


#: One entry of a Responses request's `tools`, names checked (see `_name_errors`).
ResponsesTool = Annotated[dict[str, Any], AfterValidator(_check_responses_tool)]

__all__ = [
    "NAMED_RESPONSES_TOOLS",
    "TOOL_NAME_PATTERN",
    "ResponsesTool",
    "ToolName",
    "check_tool_name",
    "is_tool_name",
]
