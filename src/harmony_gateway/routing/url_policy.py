"""Which hosts a worker registered through the admin API may point at, and worker URLs without secrets.

`POST /workers` is the admin plane: the caller holds the admin credential, and engines run on private
networks, so a worker URL may name public, private and loopback addresses alike. Two rules remain:

- Addresses that can never be an engine are refused always, whatever `--worker-allow-hosts` says
  (`netguard.unusable_address`): link-local ones (169.254.169.254, the cloud metadata service), the
  other metadata addresses, multicast, unspecified and reserved ones. A host name is resolved and each
  of its addresses checked, a listed name too.
- `--worker-allow-hosts` narrows, it never opens: when given, the URL's host must be listed by name,
  or each address it resolves to must be listed (an address or a CIDR network); anything else, public
  addresses included, is refused. A listed name that does not resolve yet is accepted (the operator
  named it); an unlisted one is refused.

Workers given on the command line (`--worker-url`, `--worker-dns`) are trusted operator config and are
not checked here.

Known limit: the engine client resolves the host again when it connects, so a DNS answer that changes
after the check (rebinding) is not caught here; list addresses rather than names where it matters.

Credentials in a worker URL (`http://user:pass@host`) are the engine's business only: metrics, logs and
API answers show `Worker.public_url` (routing/workers.py `redact_url`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from ..errors import InvalidRequest
from ..netguard import HostAllowList, IPAddress, UnresolvableHost, resolve_host, unusable_address

#: How a host becomes its addresses: `netguard.resolve_host` (host, port, timeout).
Resolve = Callable[[str, int, float], Awaitable[list[IPAddress]]]

_SCHEMES = ("grpc", "grpcs", "http", "https")


def _refused(message: str) -> InvalidRequest:
    return InvalidRequest(message, param="url", code="worker_url_not_allowed")


async def check_worker_url(
    url: str, allow: HostAllowList, *, timeout: float = 5.0, resolve: Resolve = resolve_host
) -> None:
    """Raise InvalidRequest (param `url`, code `worker_url_not_allowed`) unless the worker URL's host may
    be used (see above)."""
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
    listed_name = allow.allows_name(host)
    try:
        addresses = await resolve(host, port or 443, timeout)
    except UnresolvableHost:
        if listed_name:
            return
        raise _refused(f"the worker host {host!r} does not resolve") from None
    for address in addresses:
        reason = unusable_address(address)
        if reason is not None:
            raise _refused(f"worker host {host!r} resolves to {address}, which is {reason}: never a worker")
    if allow.empty or listed_name:
        return
    for address in addresses:
        if not allow.allows_address(address):
            raise _refused(
                f"worker host {host!r} resolves to {address}, which --worker-allow-hosts does not list"
            )
