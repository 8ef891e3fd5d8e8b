"""The `--mcp-config` YAML file: gateway-configured MCP servers and the servers backing the built-in tools.

    servers:
      docs:                              # the server_label requests and the model use
        transport: streamable_http       # streamable_http | sse | stdio
        url: https://docs.example.com/mcp
        headers: {Authorization: "Bearer ${DOCS_TOKEN}"}   # ${VAR} is read from the environment
        require_approval: never          # default for requests naming this server (always | never | filter)
        allowed_tools: [search_docs]     # optional: only these tools are offered
      sandbox:
        transport: stdio
        command: python
        args: [-m, my_sandbox]
        env: {SANDBOX_MODE: strict}
    builtins:
      browser: search                    # web_search / web_search_preview → its search, open, find tools
      python: {server: sandbox, tool: run_python}   # code_interpreter → that tool with {"code": ...}

`load_mcp_config` raises `McpConfigError` naming the offending key; nothing here touches the network.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRANSPORTS = ("streamable_http", "sse", "stdio")
_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class McpConfigError(ValueError):
    """Raised when the MCP config file is unreadable or invalid (at start-up, never per request)."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How to reach one MCP server. `headers` and `env` may hold secrets: they are kept out of repr."""

    label: str
    transport: str = "streamable_http"
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict, repr=False)
    cwd: str | None = None
    #: `always` | `never` | `{always: {tool_names}, never: {tool_names}}`; None: the request decides.
    require_approval: Any = None
    allowed_tools: tuple[str, ...] | None = None
    #: False for servers named in a request: their `server_url` passed the SSRF guard, and their
    #: connections live for one request only.
    configured: bool = True


@dataclass(frozen=True, slots=True)
class McpConfig:
    servers: dict[str, ServerConfig] = field(default_factory=dict)
    #: Label of the server whose `search` / `open` / `find` tools serve Harmony's `browser` namespace.
    browser: str | None = None
    #: Label of the server that runs `python` code, and the tool it calls with `{"code": ...}`.
    python: str | None = None
    python_tool: str = "python"


def _expand(value: str, where: str) -> str:
    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise McpConfigError(f"{where}: environment variable {name} is not set")
        return os.environ[name]

    return _VAR_RE.sub(sub, value)


def _str_map(raw: Any, where: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise McpConfigError(f"{where} must be a mapping")
    return {str(k): _expand(str(v), f"{where}.{k}") for k, v in raw.items()}


def _server(label: str, raw: Any) -> ServerConfig:
    where = f"servers.{label}"
    if not isinstance(raw, dict):
        raise McpConfigError(f"{where} must be a mapping")
    transport = raw.get("transport") or ("stdio" if raw.get("command") else "streamable_http")
    if transport not in TRANSPORTS:
        raise McpConfigError(f"{where}.transport must be one of {', '.join(TRANSPORTS)}")
    url = raw.get("url")
    command = raw.get("command")
    if transport == "stdio":
        if not isinstance(command, str) or not command:
            raise McpConfigError(f"{where}.command is required for the stdio transport")
    elif not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise McpConfigError(f"{where}.url must be an http(s) URL for the {transport} transport")
    args = raw.get("args") or []
    if not isinstance(args, list):
        raise McpConfigError(f"{where}.args must be a list")
    allowed = raw.get("allowed_tools")
    if allowed is not None and (
        not isinstance(allowed, list) or not all(isinstance(t, str) for t in allowed)
    ):
        raise McpConfigError(f"{where}.allowed_tools must be a list of tool names")
    approval = raw.get("require_approval")
    if approval is not None and approval not in ("always", "never") and not isinstance(approval, dict):
        raise McpConfigError(f"{where}.require_approval must be always, never or a filter mapping")
    return ServerConfig(
        label=label,
        transport=transport,
        url=_expand(url, f"{where}.url") if isinstance(url, str) else None,
        headers=_str_map(raw.get("headers"), f"{where}.headers"),
        command=command,
        args=tuple(_expand(str(a), f"{where}.args") for a in args),
        env=_str_map(raw.get("env"), f"{where}.env"),
        cwd=raw.get("cwd"),
        require_approval=approval,
        allowed_tools=tuple(allowed) if allowed is not None else None,
    )


def parse_mcp_config(raw: Any) -> McpConfig:
    if raw is None:
        return McpConfig()
    if not isinstance(raw, dict):
        raise McpConfigError("the MCP config must be a mapping with 'servers' (and optionally 'builtins')")
    servers_raw = raw.get("servers") or {}
    if not isinstance(servers_raw, dict):
        raise McpConfigError("servers must be a mapping from server label to its settings")
    servers = {}
    for label, entry in servers_raw.items():
        if not isinstance(label, str) or not re.fullmatch(r"[A-Za-z0-9_\-]+", label):
            raise McpConfigError(f"server label {label!r} must be letters, digits, '_' or '-'")
        if label in ("functions", "browser", "python", "container", "assistant"):
            raise McpConfigError(f"server label {label!r} is reserved by Harmony")
        servers[label] = _server(label, entry)
    builtins = raw.get("builtins") or {}
    if not isinstance(builtins, dict):
        raise McpConfigError("builtins must be a mapping")
    chosen: dict[str, str | None] = {"browser": None, "python": None}
    python_tool = "python"
    for name, entry in builtins.items():
        if name not in chosen:
            raise McpConfigError(f"builtins.{name}: only browser and python can be backed by a server")
        if isinstance(entry, dict):
            server = entry.get("server")
            if name == "python" and entry.get("tool"):
                python_tool = str(entry["tool"])
        else:
            server = entry
        if server not in servers:
            raise McpConfigError(f"builtins.{name} names {server!r}, which is not among the servers")
        chosen[name] = server
    return McpConfig(servers, chosen["browser"], chosen["python"], python_tool)


def load_mcp_config(path: str | Path) -> McpConfig:
    """Read and validate the file (blocking: call it at start-up, off the event loop)."""
    import yaml  # lazy: PyYAML only with --mcp-config

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise McpConfigError(f"cannot read the MCP config {path}: {exc}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise McpConfigError(f"the MCP config {path} is not valid YAML: {exc}") from exc
    return parse_mcp_config(raw)
