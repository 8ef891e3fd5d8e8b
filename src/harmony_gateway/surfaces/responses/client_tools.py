"""Client-executed tool kinds beyond JSON functions, as Codex declares them: `custom` (freeform) tools
such as `apply_patch` with its Lark grammar, and `local_shell`.

Harmony has one call shape, `to=functions.NAME`, so both render as functions in the developer message:

- `custom`: the description says the input is free-form text (with the grammar when one is given) and
  the function takes no JSON parameters. The model's call comes back as a `custom_tool_call` item with
  `input` = the call text exactly as generated (streamed as `response.custom_tool_call_input.delta/done`);
  a `custom_tool_call` input item replays as that call, its `custom_tool_call_output` as the tool result.
- `local_shell`: a `local_shell` function taking `{command: string[], workdir?, timeout_ms?}`; the call
  comes back as a `local_shell_call` item whose `action` is `{type: "exec", command, env, timeout_ms,
  working_directory, user}`; `local_shell_call` / `local_shell_call_output` input items replay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidRequest
from ...harmony.messages import FunctionTool

CLIENT_TOOL_KINDS = frozenset({"custom", "local_shell"})
LOCAL_SHELL = "local_shell"
_LOCAL_SHELL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "argv of the command"},
        "workdir": {"type": "string", "description": "working directory"},
        "timeout_ms": {"type": "number", "description": "time limit in milliseconds"},
    },
    "required": ["command"],
}


@dataclass(frozen=True, slots=True)
class ClientToolKinds:
    """Which function names of a request are custom tools, and whether `local_shell` is offered."""

    custom: frozenset[str] = frozenset()
    local_shell: bool = False


def client_tool(tool: dict[str, Any], param: str) -> FunctionTool:
    """The Harmony function a `custom` or `local_shell` tool renders as; InvalidRequest naming the field."""
    if tool.get("type") == LOCAL_SHELL:
        return FunctionTool(
            LOCAL_SHELL,
            "Runs a command on the user's machine and returns its output.",
            _LOCAL_SHELL_PARAMETERS,
            param,
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("custom tools need a 'name'", param=f"{param}.name")
    description = tool.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequest("description must be a string", param=f"{param}.description")
    form = tool.get("format") or {"type": "text"}
    if not isinstance(form, dict) or form.get("type") not in ("text", "grammar"):
        raise InvalidRequest("custom tool format must be text or grammar", param=f"{param}.format")
    note = "Takes free-form text as its input (not JSON): write the input itself as the call."
    if form["type"] == "grammar":
        definition = form.get("definition")
        if not isinstance(definition, str) or not definition:
            raise InvalidRequest("grammar formats need a 'definition'", param=f"{param}.format.definition")
        note += f" The input follows this {form.get('syntax') or 'lark'} grammar:\n{definition}"
    return FunctionTool(name, f"{description}\n\n{note}" if description else note, None, param)


def client_tool_kinds(tools: list[dict[str, Any]] | None) -> ClientToolKinds:
    custom = frozenset(
        t["name"]
        for t in tools or ()
        if isinstance(t, dict) and t.get("type") == "custom" and isinstance(t.get("name"), str)
    )
    shell = any(isinstance(t, dict) and t.get("type") == LOCAL_SHELL for t in tools or ())
    return ClientToolKinds(custom, shell)


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as an object: `{}` when they are empty, not JSON or not an object."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def local_shell_action(arguments: str) -> dict[str, Any]:
    """The `exec` action of a `local_shell_call` from the call's JSON arguments (a bare string command is
    split on whitespace; unparseable arguments give an empty command the client will refuse)."""
    value = arguments_object(arguments)
    command = value.get("command")
    if isinstance(command, str):
        command = command.split()
    if not isinstance(command, list):
        command = []
    timeout = value.get("timeout_ms")
    workdir = value.get("workdir") or value.get("working_directory")
    return {
        "type": "exec",
        "command": [str(c) for c in command],
        "env": {},
        "timeout_ms": int(timeout) if isinstance(timeout, (int, float)) else None,
        "working_directory": workdir if isinstance(workdir, str) else None,
        "user": None,
    }


def local_shell_arguments(action: Any) -> str:
    """The Harmony call arguments a replayed `local_shell_call` action stands for."""
    action = action if isinstance(action, dict) else {}
    args: dict[str, Any] = {"command": action.get("command") or []}
    if action.get("working_directory"):
        args["workdir"] = action["working_directory"]
    if action.get("timeout_ms"):
        args["timeout_ms"] = action["timeout_ms"]
    return json.dumps(args, separators=(",", ":"))


__all__ = [
    "CLIENT_TOOL_KINDS",
    "LOCAL_SHELL",
    "ClientToolKinds",
    "arguments_object",
    "client_tool",
    "client_tool_kinds",
    "local_shell_action",
    "local_shell_arguments",
]
