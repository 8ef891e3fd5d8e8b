"""Which hosts a worker registered through the admin API may point at (routing/url_policy.py)."""

from __future__ import annotations

import pytest

from harmony_gateway.errors import InvalidRequest
from harmony_gateway.netguard import HostAllowList
from harmony_gateway.routing.url_policy import check_worker_url


async def test_an_unresolvable_worker_host_is_a_400_on_url() -> None:
    with pytest.raises(InvalidRequest) as info:
        await check_worker_url(
            "grpc://does-not-exist.invalid:30000", HostAllowList(()), admin_listener=False, timeout=5
        )
    assert info.value.param == "url" and info.value.code == "worker_url_not_allowed"


async def test_private_addresses_only_from_the_admin_listener_or_the_allow_list() -> None:
    with pytest.raises(InvalidRequest):
        await check_worker_url("grpc://10.0.0.5:30000", HostAllowList(()), admin_listener=False)
    await check_worker_url("grpc://10.0.0.5:30000", HostAllowList(()), admin_listener=True)
    await check_worker_url("grpc://10.0.0.5:30000", HostAllowList(["10.0.0.0/24"]), admin_listener=False)


async def test_link_local_stays_refused_on_the_admin_listener() -> None:
    with pytest.raises(InvalidRequest):
        await check_worker_url("http://169.254.169.254/", HostAllowList(()), admin_listener=True)
