"""A small MCP server over stdio, run as a subprocess by the tests (`local` in the test --mcp-config)."""

from __future__ import annotations

import re

from mcp.server.mcpserver import MCPServer

server = MCPServer("local")


@server.tool()
def local_time(city: str) -> str:
    """The local time in a city."""
    return f"It is 12:00 in {city}."


@server.tool()
def run_python(code: str) -> str:
    """Run Python code (this test server only understands print of a string literal)."""
    match = re.fullmatch(r'print\("(.*)"\)', code.strip())
    return (match.group(1) if match else f"cannot run {code!r}") + "\n"


if __name__ == "__main__":
    server.run()
