"""The inspector's render does not connect to MCP servers a request names: it refuses them with a 400
(configured servers render from the gateway's pool)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import MODEL
from tests.traffic._support import chat_body, sim_and_gateway


async def test_render_does_not_connect_to_mcp_servers_named_in_the_request() -> None:
    connections: list[bool] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(True)
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with sim_and_gateway(mcp_allow_hosts=("127.0.0.1",)) as (_, gw):
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
                tool = {"type": "mcp", "server_label": "probe", "server_url": f"http://127.0.0.1:{port}/mcp"}
                r = await http.post(
                    "/v1/harmony/render",
                    json={"api": "responses", "request": {"model": MODEL, "input": "hi", "tools": [tool]}},
                )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "request.tools[0].server_url"
        assert "does not connect" in error["message"]
        assert connections == []
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_render_without_mcp_tools_still_renders(api: str) -> None:
    body = chat_body(stream=False) if api == "chat" else {"model": MODEL, "input": "hi"}
    async with sim_and_gateway() as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            r = await http.post("/v1/harmony/render", json={"api": api, "request": body})
    assert r.status_code == 200 and r.json()["token_count"] > 0
