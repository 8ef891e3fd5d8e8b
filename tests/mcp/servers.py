"""Real MCP servers for the tests, built with the official SDK's `MCPServer` (FastMCP in mcp 1.x): served
over streamable HTTP or SSE by uvicorn on 127.0.0.1:0, or over stdio by `stdio_server.py`."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

STDIO_SERVER = Path(__file__).with_name("stdio_server.py")


def stdio_command() -> tuple[str, list[str]]:
    return sys.executable, [str(STDIO_SERVER)]


def write_tools_config(folder: Path, browser_url: str) -> Path:
    """An MCP config in `folder`: `local` (stdio, also backing the python builtin) and `web` (HTTP at
    `browser_url`, backing the browser builtin)."""
    command, args = stdio_command()
    config = folder / "mcp.yaml"
    config.write_text(
        "servers:\n"
        "  local:\n"
        "    transport: stdio\n"
        f"    command: {command}\n"
        f"    args: [{args[0]}]\n"
        "    require_approval: never\n"
        "  web:\n"
        "    transport: streamable_http\n"
        f"    url: {browser_url}\n"
        "builtins:\n"
        "  browser: web\n"
        "  python: {server: local, tool: run_python}\n"
    )
    return config


def build_docs_server(calls: list[tuple[str, dict[str, Any]]]) -> MCPServer:
    """The `docs` server: a few tools with distinct behaviours; every call is recorded in `calls`."""
    server = MCPServer("docs")

    @server.tool()
    def search_docs(query: str) -> str:
        """Search the documentation."""
        calls.append(("search_docs", {"query": query}))
        return f"Docs result for {query}: the answer is 42."

    @server.tool()
    def lookup_user(name: str) -> str:
        """Look up a user by name."""
        calls.append(("lookup_user", {"name": name}))
        return f"User {name} is an administrator."

    @server.tool()
    def explode(reason: str) -> str:
        """A tool that always fails."""
        calls.append(("explode", {"reason": reason}))
        raise ToolError(f"explosion while handling {reason}")

    @server.tool()
    async def slow_tool(topic: str) -> str:
        """A tool slower than the gateway's tool timeout."""
        calls.append(("slow_tool", {"topic": topic}))
        await asyncio.sleep(5)
        return "too late"

    return server


def build_browser_server(calls: list[tuple[str, dict[str, Any]]]) -> MCPServer:
    """Backs Harmony's `browser` built-in: search / open / find."""
    server = MCPServer("browser")

    @server.tool()
    def search(query: str, topn: int = 10, source: str | None = None) -> str:
        """Search the web."""
        calls.append(("search", {"query": query, "topn": topn}))
        return f"[0] Result for {query} (example.com)\nL0: {query} is a popular topic."

    @server.tool()
    def open(id: int | str = -1, cursor: int = -1, loc: int = -1, num_lines: int = -1) -> str:
        """Open a page."""
        calls.append(("open", {"id": id}))
        return f"opened {id}"

    @server.tool()
    def find(pattern: str, cursor: int = -1) -> str:
        """Find in page."""
        calls.append(("find", {"pattern": pattern}))
        return f"found {pattern}"

    return server


@dataclass
class RunningMcp:
    url: str
    port: int
    headers_seen: list[dict[str, str]] = field(default_factory=list)


@contextlib.asynccontextmanager
async def serve_mcp(
    server: MCPServer, *, transport: str = "streamable_http", path: str = "/mcp"
) -> AsyncIterator[RunningMcp]:
    """Serve `server` on 127.0.0.1:0; records the request headers every HTTP request carried."""
    if transport == "sse":
        app = server.sse_app(sse_path=path)
    else:
        app = server.streamable_http_app(streamable_http_path=path)
    seen: list[dict[str, str]] = []

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        await app(scope, receive, send)

    config = uvicorn.Config(
        recording, host="127.0.0.1", port=0, log_level="warning", lifespan="on", log_config=None
    )
    uv = uvicorn.Server(config)
    task = asyncio.create_task(uv.serve())
    try:
        for _ in range(500):
            if uv.started or task.done():
                break
            await asyncio.sleep(0.01)
        if task.done():
            task.result()
            raise RuntimeError("MCP test server did not start")
        port = uv.servers[0].sockets[0].getsockname()[1]
        running = RunningMcp(f"http://127.0.0.1:{port}{path}", port, seen)
        yield running
    finally:
        uv.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 5)
