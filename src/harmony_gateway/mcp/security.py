"""The SSRF guard for request-declared MCP servers: a `server_url` must resolve to public addresses only.

Loopback, link-local, private, unspecified, multicast and other non-global addresses are refused with a
400 on `tools[i].server_url`, unless the URL's host, or each address it resolves to, is listed in
`--mcp-allow-hosts` (host names, IP addresses or CIDR networks). The address rules and the resolution,
bounded by a timeout and off the event loop, are the gateway's network guard (netguard.py).

Known limit: the HTTP client resolves the host again when it connects; a DNS answer that changes between
the two lookups (rebinding) is not caught here. Deployments that need that guarantee should route MCP
traffic through an egress proxy.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ..errors import InvalidRequest
from ..netguard import HostAllowList, IPAddress, UnresolvableHost, is_public, resolve_host
from .client import McpServerUnavailable


async def resolve_server_host(host: str, port: int, timeout: float) -> list[IPAddress]:
    """`resolve_host` for an MCP server: McpServerUnavailable when the host does not resolve in time."""
    try:
        return await resolve_host(host, port, timeout)
    except UnresolvableHost as exc:
        if exc.timed_out:
            raise McpServerUnavailable(f"resolving the MCP server host {host!r} timed out") from None
        raise McpServerUnavailable(f"the MCP server host {host!r} does not resolve: {exc.detail}") from None


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
    addresses = await resolve_server_host(host, port or (443 if parts.scheme == "https" else 80), timeout)
    for address in addresses:
        if not is_public(address) and not allow.allows_address(address):
            raise InvalidRequest(
                f"server_url host {host!r} resolves to the non-public address {address}; "
                "the gateway refuses it unless the host is listed in --mcp-allow-hosts",
                param=param,
                code="mcp_server_url_not_allowed",
            )
