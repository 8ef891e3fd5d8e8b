"""Which hosts a worker registered through the admin API may point at, and worker URLs without secrets.

`POST /workers` makes the gateway send every prompt of a model to the URL it is given, so a URL is
checked like an MCP `server_url` (netguard.py): its host must resolve to public addresses only, unless
the host, or each address, is listed in `--worker-allow-hosts`. A request that arrived on the admin
listener (`--admin-port`, loopback by default) is operator access: it may also name loopback and private
addresses; link-local ones (169.254.169.254, the cloud metadata service), multicast and unspecified
addresses stay refused unless listed. Workers given on the command line are trusted operator config and
are not checked.

Known limit, as for MCP: the engine client resolves the host again when it connects, so a DNS answer that
changes after the check (rebinding) is not caught here; list addresses rather than names where it matters.

Credentials in a worker URL (`http://user:pass@host`) are the engine's business only: metrics, logs and
API answers show `Worker.public_url` (routing/workers.py `redact_url`).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from ..errors import InvalidRequest
from ..netguard import HostAllowList, IPAddress, UnresolvableHost, is_public, resolve_host

_SCHEMES = ("grpc", "grpcs", "http", "https")


def _operator_network(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (address.is_loopback or address.is_private) and not address.is_link_local


async def check_worker_url(
    url: str, allow: HostAllowList, *, admin_listener: bool, timeout: float = 5.0
) -> None:
    """Raise InvalidRequest (param `url`) unless the worker URL's host may be reached (see above)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidRequest("'url' is not a valid URL", param="url") from None
    if parts.scheme not in _SCHEMES or not parts.hostname:
        return  # the engine registry names the accepted forms in its own 400
    if parts.scheme.startswith("grpc") and "@" in parts.netloc:
        # gRPC has no credentials in its target: they would only be sent to the resolver, which repeats
        # the whole target (secret included) in its errors and logs.
        raise InvalidRequest(
            "a grpc:// worker URL cannot carry credentials (user:password@)", param="url", code="invalid_url"
        )
    host = parts.hostname
    if allow.allows_name(host):
        return
    try:
        addresses = await resolve_host(host, port or 443, timeout)
    except UnresolvableHost:
        raise InvalidRequest(
            f"the worker host {host!r} does not resolve", param="url", code="worker_url_not_allowed"
        ) from None
    for address in addresses:
        if is_public(address) or allow.allows_address(address):
            continue
        if admin_listener and _operator_network(address):
            continue
        raise InvalidRequest(
            f"worker host {host!r} resolves to the non-public address {address}; the gateway refuses it "
            "unless the host is listed in --worker-allow-hosts",
            param="url",
            code="worker_url_not_allowed",
        )
