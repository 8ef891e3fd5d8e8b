"""The network-address guard shared by everything that connects where a request tells it to (an MCP
`server_url`, a worker registered through the admin API): which addresses count as public, the operator's
allow list of hosts, addresses and networks, and host resolution that never blocks the event loop.

Each caller decides what a refused or unresolvable host means on its own wire (mcp/security.py,
routing/url_policy.py); this module only answers the questions and raises `UnresolvableHost`.

Known limit: the client that connects resolves the host again; a DNS answer that changes between the
two lookups (rebinding) is not caught here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable

import anyio

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class UnresolvableHost(Exception):
    """Raised when a host name does not resolve, or not within the timeout (`timed_out`)."""

    def __init__(self, host: str, detail: str, *, timed_out: bool = False) -> None:
        super().__init__(f"{host!r}: {detail}")
        self.host = host
        self.detail = detail
        self.timed_out = timed_out


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
    """A global unicast address (an IPv4-mapped IPv6 address is judged as its IPv4 address)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


async def resolve_host(host: str, port: int, timeout: float) -> list[IPAddress]:
    """Every address `host` resolves to (an address literal is its own answer), through the event loop's
    resolver pool; raises UnresolvableHost when it does not resolve within `timeout` seconds."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        with anyio.fail_after(timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except TimeoutError:
        raise UnresolvableHost(host, "resolving timed out", timed_out=True) from None
    except OSError as exc:
        raise UnresolvableHost(host, str(exc)) from None
    out: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in out:
            out.append(address)
    return out
