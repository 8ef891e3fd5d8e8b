"""Hosted tools the gateway cannot back: left out of the prompt instead of failing the request.

Agent clients declare hosted tools by default whether or not the server can run them: Codex always sends
`{"type": "web_search"}`. With `--unbacked-tools drop` (the default) a hosted tool without a backing is not
offered to the model, is logged once per tool type per process and counted in
`gateway_unbacked_tools_dropped_total{type}`; `--unbacked-tools reject` answers 400 naming `tools[i].type`
(the strict behaviour). Backings: `web_search`/`web_search_preview` need the MCP server of the `browser`
built-in, `code_interpreter` the one of `python` (`--mcp-config`); file search, image generation and
computer use have none on this gateway.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidRequest
from ..mcp.pool import McpPool

logger = logging.getLogger(__name__)

#: Hosted tool type → the built-in whose MCP server backs it (None: nothing on this gateway can).
HOSTED_TOOLS: dict[str, str | None] = {
    "web_search": "browser",
    "web_search_preview": "browser",
    "web_search_preview_2025_03_11": "browser",
    "code_interpreter": "python",
    "file_search": None,
    "image_generation": None,
    "computer_use_preview": None,
    "computer_use": None,
}
UNBACKED_MODES = ("drop", "reject")

_logged: set[str] = set()


def backed_builtins(mcp: McpPool) -> frozenset[str]:
    """The built-ins (`browser`, `python`) the gateway's MCP configuration backs."""
    servers = {"browser": mcp.config.browser, "python": mcp.config.python}
    return frozenset(name for name, server in servers.items() if server)


#: Stands in for a dropped tool, so every later `tools[i]` error param still names the client's index.
DROPPED_TOOL: dict[str, Any] = {"type": None}


def offered_tools(
    tools: list[dict[str, Any]] | None, backed: frozenset[str], mode: str, metrics: Any = None
) -> list[dict[str, Any]] | None:
    """The request's tools with the hosted ones nothing backs replaced by `DROPPED_TOOL`."""
    dropped = unbacked_tool_indices(tools, backed, mode, metrics)
    if not dropped:
        return tools
    return [DROPPED_TOOL if i in dropped else tool for i, tool in enumerate(tools or ())]


def unbacked_tool_indices(
    tools: Sequence[Any] | None, backed: frozenset[str], mode: str, metrics: Any = None
) -> frozenset[int]:
    """Indices in `tools` of hosted tools nothing backs. `drop`: they are left out (logged once per type,
    counted); `reject`: InvalidRequest naming the first one."""
    dropped = set()
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str) or kind not in HOSTED_TOOLS:
            continue  # not a hosted tool; malformed entries are named by the later validation
        builtin = HOSTED_TOOLS[kind]
        if builtin is not None and builtin in backed:
            continue
        if mode == "reject":
            need = (
                f"an MCP server backing the '{builtin}' built-in (builtins.{builtin} in --mcp-config); "
                "none is configured"
                if builtin
                else "a backing this gateway does not have"
            )
            raise InvalidRequest(f"the {kind} tool needs {need}", param=f"tools[{i}].type")
        dropped.add(i)
        note_dropped_tool(kind, metrics)
    return frozenset(dropped)


def note_dropped_tool(kind: str, metrics: Any = None) -> None:
    """Log a dropped hosted tool type once per process; count every drop."""
    if kind not in _logged:
        _logged.add(kind)
        logger.warning(
            "hosted tool %r has no backing on this gateway; it is left out of the prompt "
            "(--unbacked-tools reject refuses such requests)",
            kind,
        )
    if metrics is not None:
        metrics.unbacked_tools_dropped.labels(kind).inc()


__all__ = [
    "DROPPED_TOOL",
    "HOSTED_TOOLS",
    "UNBACKED_MODES",
    "backed_builtins",
    "note_dropped_tool",
    "offered_tools",
    "unbacked_tool_indices",
]
