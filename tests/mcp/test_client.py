"""MCP connections against real servers: streamable HTTP, SSE (and the fallback to it), stdio, the pool."""

from __future__ import annotations

import asyncio

import pytest

from harmony_gateway.mcp.client import McpConnection, McpServerUnavailable, McpToolFailed
from harmony_gateway.mcp.config import McpConfig, ServerConfig
from harmony_gateway.mcp.pool import McpPool
from harmony_gateway.settings import Settings
from tests.mcp.servers import build_docs_server, serve_mcp, stdio_command
from tests.support.servers import wait_until


def new_pool() -> McpPool:
    # Entered inside each test: the pool's task group must be entered and left by one task.
    return McpPool(McpConfig(), Settings(mcp_tool_timeout=0.5))


def request_server(url: str, **extra) -> ServerConfig:
    return ServerConfig("docs", "streamable_http", url=url, configured=False, **extra)


async def test_streamable_http_list_and_call() -> None:
    calls: list = []
    async with new_pool() as pool, serve_mcp(build_docs_server(calls)) as running:
        connection = await pool.connect(request_server(running.url, headers={"Authorization": "Bearer x"}))
        try:
            assert connection.transport_used == "streamable_http"
            tools = {t.name: t for t in await connection.list_tools(5)}
            assert tools["search_docs"].description == "Search the documentation."
            assert tools["search_docs"].input_schema["required"] == ["query"]
            result = await connection.call_tool("search_docs", {"query": "q"}, 5)
            assert result.text == "Docs result for q: the answer is 42." and not result.is_error
            failed = await connection.call_tool("explode", {"reason": "r"}, 5)
            assert failed.is_error and "explosion while handling r" in failed.text
            with pytest.raises(McpToolFailed) as info:
                await connection.call_tool("slow_tool", {"topic": "t"}, 0.2)
            assert info.value.timed_out and info.value.to_error()["code"] == 504
        finally:
            await connection.close()
        assert not connection.alive
        assert all(h.get("authorization") == "Bearer x" for h in running.headers_seen)


@pytest.mark.parametrize("path", ["/sse", "/mcp"])
async def test_sse_server_directly_and_as_fallback(path) -> None:
    """An /sse URL is tried over SSE first; any other URL falls back to SSE when streamable HTTP fails."""
    async with new_pool() as pool, serve_mcp(build_docs_server([]), transport="sse", path=path) as running:
        connection = await pool.connect(request_server(running.url))
        try:
            assert connection.transport_used == "sse"
            result = await connection.call_tool("lookup_user", {"name": "ann"}, 5)
            assert result.text == "User ann is an administrator."
        finally:
            await connection.close()


async def test_unreachable_server() -> None:
    async with new_pool() as pool:
        with pytest.raises(McpServerUnavailable) as info:
            await pool.connect(request_server("http://127.0.0.1:9/mcp"))
    assert info.value.status_code == 424 and "docs" in info.value.message


async def test_stdio_connection_and_pool_reconnects() -> None:
    command, args = stdio_command()
    config = McpConfig({"local": ServerConfig("local", "stdio", command=command, args=tuple(args))})
    async with McpPool(config, Settings()) as pool:
        first = await pool.get("local")
        assert await pool.get("local") is first  # pooled
        assert (await first.call_tool("local_time", {"city": "Oslo"}, 5)).text == "It is 12:00 in Oslo."
        await first.close()  # the connection drops
        with pytest.raises(McpToolFailed) as info:
            await first.call_tool("local_time", {"city": "Oslo"}, 5)
        assert info.value.broken
        second = await pool.get("local")
        assert second is not first and second.alive
        assert (await second.call_tool("local_time", {"city": "Rome"}, 5)).text == "It is 12:00 in Rome."


async def test_stdio_command_that_fails() -> None:
    connection = McpConnection(
        ServerConfig("nope", "stdio", command="/nonexistent/mcp-server"), connect_timeout=2
    )
    config = McpConfig({"nope": connection.server})
    async with McpPool(config, Settings()) as pool:
        with pytest.raises(McpServerUnavailable):
            await pool.get("nope")


async def test_connect_cancelled_during_the_handshake_leaves_no_session() -> None:
    """A request cancelled while its MCP server is still connecting (the client left) must not leave
    the connection task holding a session until the app stops."""
    async with new_pool() as pool, serve_mcp(build_docs_server([])) as running:
        connection = pool._new(request_server(running.url))
        opener = asyncio.create_task(connection.open(pool._spawn))
        await asyncio.sleep(0)  # the connection task is spawned; the handshake is under way
        opener.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opener
        try:
            await wait_until(lambda: connection._done.is_set(), timeout=3)
        finally:
            await connection.close()
        assert not connection.alive
