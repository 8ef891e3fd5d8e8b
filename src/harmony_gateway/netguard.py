"""The network-address guard shared by everything that connects where a request tells it to (an MCP
`server_url`, a worker registered through the admin API): which addresses count as public, the operator's
allow list of hosts, addresses and networks, the addresses that can never be an engine whatever the
operator lists, and host resolution that never blocks the event loop.

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

    @property
    def empty(self) -> bool:
        """True when nothing is listed."""
        return not self.names and not self.networks

    def allows_name(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.names

    def allows_address(self, address: IPAddress) -> bool:
        return any(address in network for network in self.networks) or str(address) in self.names


def is_public(address: IPAddress) -> bool:
    """A global unicast address (an IPv4-mapped IPv6 address is judged as its IPv4 address)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


#: Cloud metadata services outside link-local space (169.254.169.254 is link-local): AWS's over IPv6,
#: Alibaba Cloud's, Oracle Cloud's older address.
METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200", "192.0.0.192")
)


def unusable_address(address: IPAddress) -> str | None:
    """Why `address` can never be an engine worker, or None when it can: link-local (169.254.0.0/16 holds
    the cloud metadata service; fe80::/10 needs an interface), another cloud metadata address, multicast,
    unspecified or IPv4 reserved (240.0.0.0/4, broadcast). An IPv4-mapped IPv6 address is judged as its
    IPv4 address. No allow list opens these."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_link_local:
        return "link-local (the cloud metadata service lives there)"
    if address in METADATA_ADDRESSES:
        return "a cloud metadata service"
    if address.is_multicast:
        return "multicast"
    if address.is_unspecified:
        return "unspecified"
    if isinstance(address, ipaddress.IPv4Address) and address.is_reserved:
        return "reserved"  # 240.0.0.0/4 and the broadcast address (IPv6's "reserved" ::/8 holds ::1)
    return None


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
