"""The SSRF guard for request-declared MCP servers: a `server_url` must resolve to public addresses only.

Loopback, link-local, private, unspecified, multicast and other non-global addresses are refused with a
400 on `tools[i].server_url`, unless the URL's host, or each address it resolves to, is listed in
`--mcp-allow-hosts` (host names, IP addresses or CIDR networks). Resolution runs in the resolver's thread
pool (`getaddrinfo` through the event loop), bounded by a timeout, so it never blocks the loop.

Known limit: the HTTP client resolves the host again when it connects; a DNS answer that changes between
the two lookups (rebinding) is not caught here. Deployments that need that guarantee should route MCP
traffic through an egress proxy.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

import anyio

from ..errors import InvalidRequest
from .client import McpServerUnavailable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class HostAllowList:
    """Host names (case-insensitive), addresses and networks that may be reached although not public."""

    def __init__(self, entries: Iterable[str]) -> None:
        self.names: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            entry = entry.strip()
            if not entry:
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.add(entry.lower().rstrip("."))

    def allows_name(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.names

    def allows_address(self, address: IPAddress) -> bool:
        return any(address in network for network in self.networks) or str(address) in self.names


def is_public(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


async def resolve_host(host: str, port: int, timeout: float) -> list[IPAddress]:
    """Every address `host` resolves to; raises McpServerUnavailable when it does not resolve in time."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        with anyio.fail_after(timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except TimeoutError:
        raise McpServerUnavailable(f"resolving the MCP server host {host!r} timed out") from None
    except OSError as exc:
        raise McpServerUnavailable(f"the MCP server host {host!r} does not resolve: {exc}") from None
    out: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in out:
            out.append(address)
    return out


async def check_server_url(url: str, allow: HostAllowList, *, param: str, timeout: float = 5.0) -> None:
    """Raise InvalidRequest unless `url` is http(s) and resolves only to public or allowed addresses."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidRequest("server_url is not a valid URL", param=param) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest("server_url must be an http or https URL", param=param)
    host = parts.hostname
    if allow.allows_name(host):
        return
    addresses = await resolve_host(host, port or (443 if parts.scheme == "https" else 80), timeout)
    for address in addresses:
        if not is_public(address) and not allow.allows_address(address):
            raise InvalidRequest(
                f"server_url host {host!r} resolves to the non-public address {address}; "
                "the gateway refuses it unless the host is listed in --mcp-allow-hosts",
                param=param,
                code="mcp_server_url_not_allowed",
            )
