"""The SSRF guard on request-declared MCP server URLs."""

from __future__ import annotations

import ipaddress

import pytest

from harmony_gateway.errors import InvalidRequest
from harmony_gateway.mcp.client import McpServerUnavailable
from harmony_gateway.mcp.security import check_server_url
from harmony_gateway.netguard import HostAllowList, is_public


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),
        ("::", False),
    ],
)
def test_is_public(address, public) -> None:
    assert is_public(ipaddress.ip_address(address)) is public


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/mcp",
        "http://10.0.0.1/mcp",
        "https://[::1]/mcp",
        "http://169.254.169.254/latest",
        "http://localhost:9000/mcp",
        "http://0.0.0.0/mcp",
    ],
)
async def test_private_targets_are_refused(url) -> None:
    with pytest.raises(InvalidRequest) as info:
        await check_server_url(url, HostAllowList(()), param="tools[0].server_url")
    assert info.value.param == "tools[0].server_url"
    assert info.value.code == "mcp_server_url_not_allowed"


async def test_allow_list_by_name_address_and_network() -> None:
    await check_server_url("http://127.0.0.1:1/mcp", HostAllowList(["127.0.0.1"]), param="p")
    await check_server_url("http://LocalHost:1/mcp", HostAllowList(["localhost"]), param="p")
    await check_server_url("http://10.2.3.4/mcp", HostAllowList(["10.0.0.0/8"]), param="p")
    with pytest.raises(InvalidRequest):
        await check_server_url("http://10.2.3.4/mcp", HostAllowList(["10.9.0.0/16"]), param="p")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "gopher://x", "not a url", "http://"])
async def test_only_http_urls(url) -> None:
    with pytest.raises(InvalidRequest):
        await check_server_url(url, HostAllowList(()), param="p")


async def test_unresolvable_host_is_unavailable() -> None:
    with pytest.raises(McpServerUnavailable):
        await check_server_url("http://does-not-exist.invalid/mcp", HostAllowList(()), param="p", timeout=5)
