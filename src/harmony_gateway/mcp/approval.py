"""The MCP approval flow (REFERENCE §5.5): which calls need the user's approval, the
`mcp_approval_request` item that asks for it, and the `mcp_approval_response` items that answer it.

OpenAI's rule: a request-declared server requires approval unless `require_approval` says `never` (for
every tool, or for the tool by name or by its read-only annotation). A call that needs approval is not
run: the response ends with the request item; a later request carrying `mcp_approval_response` (with
`previous_response_id` or the whole conversation) runs it or tells the model the user declined.

Only approval requests this gateway issued can be answered: `ApprovalIds` makes each request id a MAC of
the tenant and the call it asks about, so an id a client made up, one whose call was changed, and one
issued to another tenant are refused (400 naming the answer's `approval_request_id`). Nothing is stored
for it, so it holds with `store: false`, on every replica sharing the gateway key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest
from .client import McpTool


def _names(rule: Any) -> tuple[set[str], bool]:
    if not isinstance(rule, dict):
        return set(), False
    names = rule.get("tool_names") or []
    return {n for n in names if isinstance(n, str)}, bool(rule.get("read_only"))


def validate_policy(policy: Any, *, param: str) -> None:
    if policy is None or policy in ("always", "never"):
        return
    if not isinstance(policy, dict) or not set(policy) <= {"always", "never"}:
        raise InvalidRequest(
            "require_approval must be 'always', 'never' or {always: {tool_names}, never: {tool_names}}",
            param=param,
        )


def needs_approval(policy: Any, tool: McpTool | None, name: str) -> bool:
    """True unless the policy exempts this tool (no policy at all: approval required, as OpenAI does)."""
    if policy == "never":
        return False
    if policy is None or policy == "always" or not isinstance(policy, dict):
        return True
    read_only = tool.read_only if tool is not None else False
    never, never_read_only = _names(policy.get("never"))
    always, always_read_only = _names(policy.get("always"))
    if name in always or (always_read_only and read_only):
        return True
    return not (name in never or (never_read_only and read_only))


#: The label deriving the approval id key from the gateway key (no other use of that key shares it).
APPROVAL_KEY_PURPOSE = b"harmony-gateway mcp approval ids v1"
_NONCE_BYTES = 12
_MAC_BYTES = 16
_ID_RE = re.compile(rf"mcpr_([0-9a-f]{{{2 * _NONCE_BYTES}}})([0-9a-f]{{{2 * _MAC_BYTES}}})")


class ApprovalIds:
    """Issues and checks the approval request ids of one tenant.

    An id is `mcpr_` + a random nonce + an HMAC-SHA256 (truncated to 128 bits) under a key derived from
    the gateway key, over the nonce, the tenant and the call: server label, tool name and the arguments
    exactly as generated. Checking recomputes the MAC from the request item the answer points at, so
    the item's call cannot be changed either."""

    def __init__(self, key: bytes, owner: str) -> None:
        self._key = key
        self._owner = owner

    def issue(self, server_label: str, name: str, arguments: str) -> str:
        nonce = os.urandom(_NONCE_BYTES).hex()
        return f"mcpr_{nonce}{self._mac(nonce, server_label, name, arguments)}"

    def issued(self, request: dict[str, Any]) -> bool:
        """True when this `mcp_approval_request` item is one this gateway issued to this tenant, unchanged."""
        request_id = request.get("id")
        found = _ID_RE.fullmatch(request_id) if isinstance(request_id, str) else None
        label, name, arguments = request.get("server_label"), request.get("name"), request.get("arguments")
        if found is None or not (
            isinstance(label, str) and isinstance(name, str) and isinstance(arguments, str)
        ):
            return False
        return hmac.compare_digest(self._mac(found.group(1), label, name, arguments), found.group(2))

    def _mac(self, nonce: str, server_label: str, name: str, arguments: str) -> str:
        """The MAC of a call issued to this tenant under `nonce`."""
        # JSON keeps the fields apart (no separator can be forged into a name) and takes any string.
        message = json.dumps([nonce, self._owner, server_label, name, arguments]).encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[: 2 * _MAC_BYTES]


def approval_request_item(ids: ApprovalIds, server_label: str, name: str, arguments: str) -> dict[str, Any]:
    """The `mcp_approval_request` item asking the user about one call, under an id issued for it."""
    return {
        "type": "mcp_approval_request",
        "id": ids.issue(server_label, name, arguments),
        "server_label": server_label,
        "name": name,
        "arguments": arguments,
    }


def answers_approvals(items: Iterable[dict[str, Any]]) -> bool:
    """True when the input answers approval requests (`mcp_approval_response` items)."""
    return any(item.get("type") == "mcp_approval_response" for item in items)


@dataclass(frozen=True, slots=True)
class ApprovalDecision:
    """An `mcp_approval_response` matched with the request it answers."""

    request: dict[str, Any]
    approve: bool
    reason: str | None
    position: int  # index of the response among this request's input items

    @property
    def request_id(self) -> str:
        return str(self.request["id"])


def match_approvals(
    items: list[dict[str, Any]], known: Iterable[dict[str, Any]], ids: ApprovalIds, *, param: str = "input"
) -> list[ApprovalDecision]:
    """Pair each `mcp_approval_response` of `items` with an earlier `mcp_approval_request` of the chain or
    conversation (`known`), or of `items` itself. Unknown ids, requests `ids` did not issue (made up,
    changed, or another tenant's) and already answered ids are 400."""
    requests: dict[str, dict[str, Any]] = {}
    answered: set[str] = set()
    for item in (*known, *items):
        kind = item.get("type")
        if kind == "mcp_approval_request" and isinstance(item.get("id"), str):
            requests[item["id"]] = item
    for item in known:
        if item.get("type") == "mcp_approval_response":
            answered.add(str(item.get("approval_request_id")))
        elif item.get("type") == "mcp_call" and item.get("approval_request_id"):
            answered.add(str(item["approval_request_id"]))
    decisions = []
    for i, item in enumerate(items):
        if item.get("type") != "mcp_approval_response":
            continue
        where = f"{param}[{i}].approval_request_id"
        request_id = item["approval_request_id"]
        request = requests.get(request_id)
        if request is None:
            raise InvalidRequest(f"No mcp_approval_request found with id {request_id!r}", param=where)
        if not ids.issued(request):
            raise InvalidRequest(
                f"The approval request {request_id!r} was not issued by this gateway for this call: "
                "answer the mcp_approval_request items the gateway returned, unchanged",
                param=where,
            )
        if request_id in answered:
            raise InvalidRequest(f"The approval request {request_id!r} was already answered", param=where)
        answered.add(request_id)
        reason = item.get("reason")
        decisions.append(
            ApprovalDecision(request, item["approve"], reason if isinstance(reason, str) else None, i)
        )
    return decisions


def declined_text(reason: str | None) -> str:
    text = "The user declined to run this tool call; it was not executed."
    return f"{text} Reason: {reason}" if reason else text
