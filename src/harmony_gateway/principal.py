"""Who is asking: the `Principal` an API key authenticates to, and the one function that finds it.

Every per-tenant value the gateway keeps or looks up (stored responses and conversations, restorable
reasoning, AEAD associated data, routing-index namespaces, budgets, background runs) is derived from the
request's Principal, never from a header read somewhere else. Engine request ids are not: the gateway
makes them itself (`RequestContext.engine_id`), so no client value ever names another request at an engine.

A key file entry may name its tenant (`sk-ops-1 tenant=ops`): keys of one tenant share what they store;
without it every key is its own tenant. On a gateway without keys every request is `ANONYMOUS`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from .settings import KeyPolicy

#: Stored objects of a named tenant are owned by this prefix plus the name; a bare key's tenant is its
#: hex key id, which can never start with it, so a name never collides with a key's own tenant.
TENANT_PREFIX = "tenant:"


@dataclass(frozen=True, slots=True)
class Principal:
    #: A hash of the presented key: safe to log and to count by; "" on a gateway without keys.
    key_id: str
    #: What owns stored objects and namespaces per-tenant state: a key file's `tenant=NAME`, else the key id.
    tenant: str
    #: An `--admin-key`: the admin plane only (api/admin.py); an admin key is never a tenant key.
    admin: bool = False

    @property
    def tenant_name(self) -> str:
        """The key file's `tenant=NAME`; "" for a key that is its own tenant, and without keys."""
        return self.tenant[len(TENANT_PREFIX) :] if self.tenant.startswith(TENANT_PREFIX) else ""


ANONYMOUS = Principal(key_id="", tenant="")
#: An admin credential on a tenant-plane route that shows fleet details (the prompt inspector): its
#: tenant is no key id (hex), no named tenant (`TENANT_PREFIX`) and not the open gateway's "", so it finds
#: no tenant's stored data and shares no tenant's routing namespace.
ADMIN = Principal(key_id="", tenant="@admin", admin=True)


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def presented_key(headers: Mapping[str, str]) -> str:
    """The key of `Authorization: Bearer KEY`, else of `x-api-key` (Anthropic's SDK); "" when neither."""
    header = headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    return headers.get("x-api-key", "").strip()


class KeySource(Protocol):
    """The tenant keys in force and the key file's entries: the app's `traffic.keys.KeyRing` (which a
    key file reload changes), or fixed `Settings`."""

    @property
    def api_keys(self) -> frozenset[str]: ...

    @property
    def key_policies(self) -> Mapping[str, KeyPolicy]: ...


def authenticate(keys: KeySource, headers: Mapping[str, str]) -> Principal | None:
    """The tenant principal of a request; None when keys are configured and the request's key is missing
    or not a tenant key (the route answers 401). Admin keys authenticate on the admin plane only."""
    if not keys.api_keys:
        return ANONYMOUS
    key = presented_key(headers)
    if not key or key not in keys.api_keys:
        return None
    return tenant_principal(keys, key)


def tenant_principal(keys: KeySource, key: str) -> Principal:
    identity = key_id(key)
    policy = keys.key_policies.get(key)
    tenant = policy.tenant if policy is not None else None
    return Principal(key_id=identity, tenant=TENANT_PREFIX + tenant if tenant else identity)
