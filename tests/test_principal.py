"""The Principal a request authenticates to: key ids, tenants shared through the key file, the open gateway."""

from __future__ import annotations

import pytest

from harmony_gateway.principal import ANONYMOUS, TENANT_PREFIX, authenticate, key_id, presented_key
from harmony_gateway.settings import Settings
from harmony_gateway.traffic.keys import KeyPolicy, parse_key_line


def _settings(*lines: str) -> Settings:
    entries = [entry for line in lines if (entry := parse_key_line(line)) is not None]
    return Settings(api_keys=frozenset(k for k, _ in entries), key_policies=dict(entries))


def test_an_open_gateway_answers_every_request_as_the_anonymous_principal() -> None:
    assert authenticate(Settings(), {}) is ANONYMOUS
    assert authenticate(Settings(), {"authorization": "Bearer anything"}) is ANONYMOUS


def test_a_key_is_its_own_tenant_unless_the_key_file_names_one() -> None:
    settings = _settings("sk-solo", "sk-ops-1 tenant=ops", "sk-ops-2 tenant=ops rate_limit=5")
    solo = authenticate(settings, {"authorization": "Bearer sk-solo"})
    ops1 = authenticate(settings, {"authorization": "Bearer sk-ops-1"})
    ops2 = authenticate(settings, {"x-api-key": "sk-ops-2"})
    assert solo is not None and ops1 is not None and ops2 is not None
    assert solo.tenant == solo.key_id == key_id("sk-solo") and "sk-solo" not in solo.key_id
    assert ops1.tenant == ops2.tenant == TENANT_PREFIX + "ops"
    assert ops1.key_id != ops2.key_id and not (ops1.admin or ops2.admin)
    # A tenant name can never equal a bare key's tenant (a hex key id).
    assert not solo.tenant.startswith(TENANT_PREFIX)


@pytest.mark.parametrize(
    "headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": "Basic sk-solo"}, {"x-api-key": ""}]
)
def test_a_missing_or_unknown_key_authenticates_to_nobody(headers: dict[str, str]) -> None:
    assert authenticate(_settings("sk-solo"), headers) is None


def test_the_presented_key_prefers_the_bearer_header() -> None:
    assert presented_key({"authorization": "bearer  k1 ", "x-api-key": "k2"}) == "k1"
    assert presented_key({"x-api-key": "k2"}) == "k2"


def test_a_tenant_name_is_checked_when_the_key_file_is_read() -> None:
    assert parse_key_line("sk tenant=team-a.eu") == ("sk", KeyPolicy(tenant="team-a.eu"))
    for bad in ("sk tenant=", "sk tenant=a/b", f"sk tenant={'x' * 65}"):
        with pytest.raises(ValueError, match="tenant"):
            parse_key_line(bad)
