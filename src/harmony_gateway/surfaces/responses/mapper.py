"""Responses input items: normalisation (ids, content parts) and mapping to Harmony messages (REFERENCE §2.4).

Items are normalised once, when a request arrives, so that storage, `input_items` listings and
conversations all see the same item dicts with ids.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from ...errors import InvalidRequest
from ...harmony.messages import Msg, assistant, assistant_call, tool_result, user
from ...mcp.approval import declined_text
from ...mcp.tool_loop import error_text
from ..harmony_history import HarmonyHistory
from .client_tools import LOCAL_SHELL, local_shell_arguments
from .compaction import summary_message

ITEM_PREFIXES = {
    "message": "msg",
    "reasoning": "rs",
    "function_call": "fc",
    "function_call_output": "fco",
    "mcp_list_tools": "mcpl",
    "mcp_call": "mcp",
    "mcp_approval_request": "mcpr",
    "mcp_approval_response": "mcpa",
    "web_search_call": "ws",
    "custom_tool_call": "ctc",
    "custom_tool_call_output": "ctco",
    "local_shell_call": "lsh",
    "local_shell_call_output": "lsho",
    "code_interpreter_call": "ci",
    "item_reference": "ref",
    "compaction": "cmp",
}
TEXT_PARTS = {"input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"}
MESSAGE_ROLES = {"user", "assistant", "system", "developer"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"


def _parts(content: Any, role: str, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        if role == "assistant":
            return [_output_part({"type": "output_text", "text": content})]
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest("message content must be a string or a list of parts", param=param)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise InvalidRequest("content parts must be objects", param=f"{param}[{j}]")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise InvalidRequest("content parts need a string 'type'", param=f"{param}[{j}].type")
        if kind in ("input_image", "input_file", "input_audio", "image_url", "computer_screenshot"):
            raise InvalidRequest(
                f"content part type {kind!r} is not supported: this model accepts text only",
                param=f"{param}[{j}]",
            )
        if kind not in TEXT_PARTS:
            raise InvalidRequest(f"unknown content part type {kind!r}", param=f"{param}[{j}].type")
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise InvalidRequest("text parts must carry a string 'text'", param=f"{param}[{j}].text")
        out.append(_output_part(part) if kind == "output_text" else part)
    return out


def _output_part(part: dict[str, Any]) -> dict[str, Any]:
    """An `output_text` part as it is stored and listed: with the `annotations` and `logprobs` the
    schema requires (a client sending an answer back often leaves them out)."""
    if "annotations" in part and "logprobs" in part:
        return part
    return {"annotations": [], "logprobs": [], **part}


def normalize_items(
    raw: str | list[dict[str, Any]], *, param: str = "input", references: bool = True
) -> list[dict[str, Any]]:
    """Input as item dicts with ids and list-of-parts content. Raises InvalidRequest naming the field;
    `item_reference`s only with `references` (a conversation stores items, never pointers to them)."""
    if isinstance(raw, str):
        return [
            {
                "type": "message",
                "id": new_id("msg"),
                "role": "user",
                "content": [{"type": "input_text", "text": raw}],
                "status": "completed",
            }
        ]
    items = []
    for i, item in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest("input items must be objects", param=where)
        item = dict(item)
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = item["type"] = "message"
        if not isinstance(kind, str) or kind not in ITEM_PREFIXES:
            raise InvalidRequest(f"Unknown input item type {kind!r}", param=f"{where}.type")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in MESSAGE_ROLES:
                raise InvalidRequest(f"invalid message role {role!r}", param=f"{where}.role")
            item["content"] = _parts(item.get("content", ""), role, f"{where}.content")
            item.setdefault("status", "completed")
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise InvalidRequest(f"function_call items need a string {key!r}", param=f"{where}.{key}")
            if not isinstance(item.get("arguments", ""), str):
                raise InvalidRequest(
                    "function_call arguments must be a JSON string", param=f"{where}.arguments"
                )
            item.setdefault("arguments", "")
            item.setdefault("status", "completed")
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(
                    "function_call_output items need a string 'call_id'", param=f"{where}.call_id"
                )
            output = item.get("output")
            if not isinstance(output, (str, list)):
                raise InvalidRequest(
                    "function_call_output 'output' must be a string or parts", param=f"{where}.output"
                )
            item.setdefault("status", "completed")
        elif kind in ("custom_tool_call", "local_shell_call"):
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise InvalidRequest(f"{kind} items need a string 'call_id'", param=f"{where}.call_id")
            if kind == "custom_tool_call":
                if not isinstance(item.get("name"), str) or not item["name"]:
                    raise InvalidRequest("custom_tool_call items need a 'name'", param=f"{where}.name")
                if not isinstance(item.get("input", ""), str):
                    raise InvalidRequest("custom_tool_call input must be a string", param=f"{where}.input")
            item.setdefault("status", "completed")
        elif kind in ("custom_tool_call_output", "local_shell_call_output"):
            call_id = item.get("call_id") or (item.get("id") if kind == "local_shell_call_output" else None)
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(f"{kind} items need a string 'call_id'", param=f"{where}.call_id")
            item["call_id"] = call_id
            if not isinstance(item.get("output"), (str, list)):
                raise InvalidRequest(f"{kind} 'output' must be a string or parts", param=f"{where}.output")
            if kind == "custom_tool_call_output":
                item.setdefault("status", "completed")
        elif kind == "mcp_approval_request":
            # The call it asks about is replayed as a message and checked against its id: text only.
            for key in ("server_label", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise InvalidRequest(
                        f"mcp_approval_request items need a string {key!r}", param=f"{where}.{key}"
                    )
        elif kind == "mcp_approval_response":
            if not isinstance(item.get("approval_request_id"), str):
                raise InvalidRequest(
                    "mcp_approval_response items need an 'approval_request_id'",
                    param=f"{where}.approval_request_id",
                )
            if not isinstance(item.get("approve"), bool):
                raise InvalidRequest(
                    "mcp_approval_response items need a boolean 'approve'", param=f"{where}.approve"
                )
        elif kind == "compaction":
            sealed = item.get("encrypted_content")
            if not isinstance(sealed, str) or not sealed:
                raise InvalidRequest(
                    "compaction items need the 'encrypted_content' a compaction produced",
                    param=f"{where}.encrypted_content",
                )
        elif kind == "item_reference" and not references:
            raise InvalidRequest(
                "conversation items are stored as sent: send the item itself, not an item_reference",
                param=f"{where}.type",
            )
        elif kind == "item_reference" and not isinstance(item.get("id"), str):
            raise InvalidRequest("item_reference items need an 'id'", param=f"{where}.id")
        _check_field_types(kind, item, where)
        if item.get("id") is not None and not isinstance(item["id"], str):
            raise InvalidRequest("item ids must be strings", param=f"{where}.id")
        if kind != "item_reference" and not item.get("id"):
            item["id"] = new_id(ITEM_PREFIXES[kind])
        items.append(item)
    return items


_OPTIONAL_STR = (str, type(None))
#: Fields replayed into the prompt from items a client sends back (REFERENCE §2.4), and what each must
#: be when present (a required field's absence is for the item's own rules above).
_FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "reasoning": {"encrypted_content": _OPTIONAL_STR},
    "mcp_call": {
        "server_label": (str,),
        "name": (str,),
        "arguments": _OPTIONAL_STR,
        "output": _OPTIONAL_STR,
        "error": (str, dict, type(None)),
    },
    "mcp_approval_request": {"server_label": (str,), "name": (str,), "arguments": _OPTIONAL_STR},
    "mcp_list_tools": {"server_label": (str,)},
    "code_interpreter_call": {"code": _OPTIONAL_STR},
}
#: List fields of objects (text parts, listed tools, outputs), with what each object's fields must be.
_OBJECT_LISTS: dict[str, dict[str, dict[str, tuple[type, ...]]]] = {
    "reasoning": {"content": {"text": (str,)}, "summary": {"text": (str,)}},
    "mcp_list_tools": {
        "tools": {"name": (str,), "description": _OPTIONAL_STR, "input_schema": (dict, type(None))}
    },
    "code_interpreter_call": {"outputs": {}},
}
_TYPE_NAMES: dict[type, str] = {str: "a string", dict: "an object", list: "a list", type(None): "null"}


def _must_be(value: Any, types: tuple[type, ...], what: str, param: str) -> None:
    if not isinstance(value, types):
        expected = " or ".join(_TYPE_NAMES[t] for t in types)
        raise InvalidRequest(f"{what} must be {expected}", param=param)


def _check_field_types(kind: str, item: dict[str, Any], where: str) -> None:
    """Raise InvalidRequest naming the first field of an input item whose JSON type is wrong (a number
    where the prompt needs text), before anything renders it."""
    for key, types in _FIELD_TYPES.get(kind, {}).items():
        if key in item:
            _must_be(item[key], types, f"{kind} '{key}'", f"{where}.{key}")
    for key, fields in _OBJECT_LISTS.get(kind, {}).items():
        entries = item.get(key)
        _must_be(entries, (list, type(None)), f"{kind} '{key}'", f"{where}.{key}")
        for j, entry in enumerate(entries or ()):
            _must_be(entry, (dict,), f"{kind} '{key}' entries", f"{where}.{key}[{j}]")
            for name, types in fields.items():
                if name in entry:
                    _must_be(entry[name], types, f"'{name}'", f"{where}.{key}[{j}].{name}")


def part_text(parts: Any) -> str:
    if isinstance(parts, str):
        return parts
    pieces = []
    for part in parts or ():
        if isinstance(part, dict):
            value = part.get("text", part.get("refusal", ""))
            if isinstance(value, str):
                pieces.append(value)
    return "".join(pieces)


def call_recipient(item: dict[str, Any]) -> str:
    """The Harmony recipient of a function_call item: `functions.NAME`, or `NAMESPACE.NAME` for a tool of
    a client-declared namespace."""
    namespace = item.get("namespace")
    return f"{namespace}.{item['name']}" if namespace else "functions." + item["name"]


def call_names_of(items: Iterable[dict[str, Any]]) -> dict[str, str]:
    """call_id → the recipient the call went to (its tool result is authored by that name)."""
    names: dict[str, str] = {}
    for item in items:
        kind = item.get("type")
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            continue
        if kind == "function_call":
            names[call_id] = call_recipient(item)
        elif kind == "custom_tool_call" and isinstance(item.get("name"), str):
            names[call_id] = "functions." + item["name"]
        elif kind == "local_shell_call":
            names[call_id] = "functions." + LOCAL_SHELL
            if isinstance(item.get("id"), str):
                names[item["id"]] = "functions." + LOCAL_SHELL  # its output may name the item id
    return names


def items_to_messages(
    items: list[dict[str, Any]],
    call_names: dict[str, str],
    *,
    param: str = "input",
    leading_instructions: list[str] | None = None,
    resolve_reference: Any = None,
    mcp_replay: Any = None,
    open_reasoning: Any = None,
    open_summary: Any = None,
) -> list[Msg]:
    """Map items to Harmony messages. Leading system/developer messages go to `leading_instructions`
    when that list is given (they become the developer message's instructions). `open_reasoning(blob,
    param=...)` decrypts a reasoning item's `encrypted_content` (`reasoning_store.ReasoningVault.open`);
    without it such items render from their `content`. `open_summary(blob, param=...)` opens a compaction
    item's (`ReasoningVault.open_summary`), which then renders as its summary (`compaction.py`); without
    it a compaction item is refused."""
    history = HarmonyHistory(leading_instructions)
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if item.get("type") == "item_reference":
            if resolve_reference is None:
                raise InvalidRequest(f"item {item.get('id')!r} not found", param=f"{where}.id")
            item = resolve_reference(item["id"], where)
        if item.get("type") == "message" and item["role"] in ("system", "developer"):
            history.system(part_text(item.get("content")))
        else:
            history.add(*_item_messages(item, where, call_names, mcp_replay, open_reasoning, open_summary))
    return history.messages


def _item_messages(
    item: dict[str, Any],
    where: str,
    call_names: dict[str, str],
    mcp_replay: Any,
    open_reasoning: Any,
    open_summary: Any,
) -> list[Msg]:
    """The Harmony messages of one item other than a system or developer message (`items_to_messages`)."""
    kind = item.get("type")
    if kind == "compaction":
        param = f"{where}.encrypted_content"
        if open_summary is None:
            raise InvalidRequest("compaction items cannot be used here", param=param)
        # Sealed by this gateway for this tenant: a changed or foreign blob is a 400, never ignored.
        return [summary_message(open_summary(item.get("encrypted_content"), param=param))]
    if kind == "message":
        text = part_text(item.get("content"))
        if item["role"] == "user":
            return [user(text)]
        phase = "commentary" if item.get("phase") == "commentary" else "final"
        return [assistant(text, phase)] if text else []
    if kind == "reasoning":
        texts = [c.get("text", "") for c in item.get("content") or () if isinstance(c, dict)]
        sealed = item.get("encrypted_content")
        if sealed is not None and open_reasoning is not None:
            # The sealed text is what the gateway produced; a changed blob is a 400, never ignored.
            texts = [open_reasoning(sealed, param=f"{where}.encrypted_content")]
        return [assistant("\n".join(texts), "analysis")] if texts else []
    if kind == "function_call":
        return [assistant_call(call_recipient(item), item.get("arguments") or "")]
    if kind == "custom_tool_call":
        # Freeform input exactly as generated: no `<|constrain|>json`.
        return [assistant_call("functions." + item["name"], item.get("input") or "", content_type=None)]
    if kind == "local_shell_call":
        return [assistant_call("functions." + LOCAL_SHELL, local_shell_arguments(item.get("action")))]
    if kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
        name = call_names.get(item["call_id"])
        if name is None:
            raise InvalidRequest(
                f"No tool call found for function call output with call_id {item['call_id']!r}",
                param=f"{where}.call_id",
            )
        return [tool_result(name, part_text(item.get("output")))]
    if kind in REPLAYED_KINDS and mcp_replay is not None:
        return list(mcp_replay(item))
    return []  # web_search_call without a stored result: omitted (REFERENCE §2.4)


REPLAYED_KINDS = frozenset(
    {"mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "code_interpreter_call"}
)


class McpReplay:
    """Maps stored MCP and code-interpreter items back to Harmony messages (REFERENCE §2.4, §5.3); pass an
    instance as `mcp_replay` to `items_to_messages`. Stateful over one item sequence: a denied
    `mcp_approval_response` becomes the "declined" tool message of the request it answers.

    - `mcp_list_tools`: nothing (tools are declared from the listing, not replayed as messages)
    - `mcp_call`: the call (`label.name`, commentary, JSON) and its tool message (output, or the error);
      a call that followed an approval has only the tool message (the request item carried the call)
    - `mcp_approval_request`: the call message, awaiting its answer
    - `mcp_approval_response`: for the current input, the tool message `placeholders` holds (the pipeline
      fills it in once the call ran); in history, a denial's tool message, else nothing
    - `code_interpreter_call`: the `python` call (analysis, its code) and its logs as the tool message
    """

    def __init__(self, placeholders: dict[str, Msg] | None = None) -> None:
        self.requests: dict[str, dict[str, Any]] = {}
        self.placeholders = placeholders or {}

    def __call__(self, item: dict[str, Any]) -> list[Msg]:
        kind = item.get("type")
        if kind == "mcp_call":
            recipient = f"{item.get('server_label', '')}.{item.get('name', '')}"
            error = item.get("error")
            output = item.get("output")
            if error:
                text = f"Error: {error_text(error)}"
            else:
                text = output if isinstance(output, str) else ""
            result = tool_result(recipient, text)
            if item.get("approval_request_id") in self.requests:
                return [result]
            return [assistant_call(recipient, item.get("arguments") or ""), result]
        if kind == "mcp_approval_request":
            self.requests[str(item.get("id"))] = item
            recipient = f"{item.get('server_label', '')}.{item.get('name', '')}"
            return [assistant_call(recipient, item.get("arguments") or "")]
        if kind == "mcp_approval_response":
            request_id = str(item.get("approval_request_id"))
            if request_id in self.placeholders:
                return [self.placeholders[request_id]]
            request = self.requests.get(request_id)
            if request is not None and item.get("approve") is False:
                recipient = f"{request.get('server_label', '')}.{request.get('name', '')}"
                reason = item.get("reason")
                return [tool_result(recipient, declined_text(reason if isinstance(reason, str) else None))]
            return []
        if kind == "code_interpreter_call":
            code = item.get("code")
            if not isinstance(code, str) or not code:
                return []
            logs = "\n".join(
                str(o.get("logs", ""))
                for o in item.get("outputs") or ()
                if isinstance(o, dict) and o.get("type") == "logs"
            )
            return [
                assistant_call("python", code, channel="analysis", content_type="code"),
                tool_result("python", logs, channel="analysis"),
            ]
        return []
