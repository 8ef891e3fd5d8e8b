"""`DnsResolver`: the `dns_discovery.Resolver` that asks a real DNS server, through dnspython's asyncio
resolver. dnspython's errors are translated here, once: NXDOMAIN and an empty answer are an empty list,
every other failure is `LookupFailed`.

By default it asks the system's servers with the system's search list and `ndots` (/etc/resolv.conf, as
libc would: in a Kubernetes pod `engines` alone finds `engines.<namespace>.svc.cluster.local`; a trailing
dot skips the search list). `server` names one nameserver instead, with no search list. Nothing is
cached: each lookup asks the server, which applies the records' TTL itself.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

import anyio
import dns.asyncresolver
import dns.exception
import dns.name
import dns.rdtypes.IN.SRV
import dns.resolver

from ..netguard import IPAddress
from .dns_discovery import DEFAULT_TIMEOUT, LookupFailed, ServiceRecord, parse_nameserver

#: Extra time allowed past dnspython's own lifetime before a query is abandoned all the same.
_GRACE = 0.5


class DnsResolver:
    """Raises ValueError at construction when `server` is None and the system names no nameserver.
    Each query is bounded by `timeout` seconds (retries and the search list included)."""

    def __init__(self, server: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        if server is None:
            try:
                self._resolver = dns.asyncresolver.Resolver()  # reads /etc/resolv.conf once, here
            except dns.resolver.NoResolverConfiguration:
                raise ValueError(
                    "--worker-dns: the system names no nameserver (/etc/resolv.conf); "
                    "pass --worker-dns-server ADDRESS[:PORT]"
                ) from None
            self._search: bool | None = True
        else:
            address, port = parse_nameserver(server)
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [address]
            self._resolver.port = port
            self._search = False
        self._resolver.timeout = timeout
        self._resolver.lifetime = timeout
        self._resolver.cache = None

    @property
    def nameservers(self) -> list[str]:
        return [str(server) for server in self._resolver.nameservers]

    async def _query(self, name: str, rdtype: str) -> dns.resolver.Answer | None:
        """The answer, or None for NXDOMAIN; an answer may hold no records."""
        try:
            with anyio.fail_after(self.timeout + _GRACE):
                return await self._resolver.resolve(
                    name, rdtype, lifetime=self.timeout, search=self._search, raise_on_no_answer=False
                )
        except dns.resolver.NXDOMAIN:
            return None
        except (dns.exception.Timeout, TimeoutError):
            raise LookupFailed(
                name, "timeout", f"{rdtype} query got no answer in {self.timeout:g} s"
            ) from None
        except dns.resolver.NoNameservers as exc:
            raise LookupFailed(name, "servfail", str(exc)) from None
        except (dns.exception.DNSException, OSError) as exc:
            raise LookupFailed(name, "error", f"{type(exc).__name__}: {exc}") from None

    async def addresses(self, name: str, rdtype: Literal["A", "AAAA"]) -> list[IPAddress]:
        answer = await self._query(name, rdtype)
        if answer is None or answer.rrset is None:
            return []
        return [ipaddress.ip_address(record.address) for record in answer.rrset]

    async def services(self, name: str) -> list[ServiceRecord]:
        answer = await self._query(name, "SRV")
        if answer is None or answer.rrset is None:
            return []
        out = []
        for record in answer.rrset:
            assert isinstance(record, dns.rdtypes.IN.SRV.SRV)
            if record.target != dns.name.root:  # "." : the service is not offered there
                out.append(ServiceRecord(record.target.to_text(), record.port))
        return out
