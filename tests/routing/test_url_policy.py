"""Which hosts a worker registered through the admin API may point at (routing/url_policy.py)."""

from __future__ import annotations

import ipaddress

import pytest

from harmony_gateway.errors import InvalidRequest
from harmony_gateway.netguard import HostAllowList, IPAddress
from harmony_gateway.routing.url_policy import check_worker_url

NO_LIST = HostAllowList(())


async def test_an_unresolvable_worker_host_is_a_400_on_url() -> None:
    with pytest.raises(InvalidRequest) as info:
        await check_worker_url("grpc://does-not-exist.invalid:30000", NO_LIST, timeout=5)
    assert info.value.param == "url" and info.value.code == "worker_url_not_allowed"


@pytest.mark.parametrize(
    "url",
    [
        "grpc://10.0.0.7:30000",  # an engine on the cluster's private network
        "grpc://192.168.1.20:30000",
        "grpc://172.16.0.4:30000",
        "grpc://127.0.0.1:30000",
        "grpc://localhost:30000",
        "grpc://[::1]:30000",
        "grpc://[fd00::3]:30000",  # IPv6 unique local
        "grpc://100.64.1.2:30000",  # carrier-grade NAT space some pod networks use
        "grpc://8.8.8.8:30000",
    ],
)
async def test_without_an_allow_list_private_loopback_and_public_engines_are_accepted(url: str) -> None:
    await check_worker_url(url, NO_LIST)


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data",  # the cloud metadata service
        "grpc://169.254.10.1:30000",  # link-local
        "grpc://[fe80::1]:30000",
        "grpc://[::ffff:169.254.169.254]:30000",
        "grpc://[fd00:ec2::254]:30000",  # AWS's metadata service over IPv6
        "grpc://100.100.100.200:30000",  # Alibaba Cloud's metadata service
        "grpc://0.0.0.0:30000",
        "grpc://224.0.0.1:30000",
        "grpc://255.255.255.255:30000",
    ],
)
async def test_metadata_and_link_local_addresses_are_refused_even_when_listed(url: str) -> None:
    for allow in (NO_LIST, HostAllowList(["0.0.0.0/0", "::/0", "169.254.169.254"])):
        with pytest.raises(InvalidRequest) as info:
            await check_worker_url(url, allow)
        assert info.value.param == "url" and info.value.code == "worker_url_not_allowed"
        assert "never" in info.value.message


async def test_an_allow_list_narrows_the_hosts_a_worker_may_use() -> None:
    allow = HostAllowList(["10.0.0.0/24", "engine.internal"])
    await check_worker_url("grpc://10.0.0.5:30000", allow)
    for url in ("grpc://10.0.1.5:30000", "grpc://127.0.0.1:30000", "grpc://8.8.8.8:30000"):
        with pytest.raises(InvalidRequest) as info:
            await check_worker_url(url, allow)
        assert info.value.code == "worker_url_not_allowed"
        assert "--worker-allow-hosts" in info.value.message
    # A listed name is accepted as the operator's own, even before it resolves.
    await check_worker_url("grpc://engine.internal:30000", allow, timeout=5)


async def test_a_listed_name_is_still_resolved_and_refused_when_it_names_the_metadata_service() -> None:
    async def metadata_service(host: str, port: int, timeout: float) -> list[IPAddress]:
        assert (host, port) == ("engine.internal", 30000)
        return [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("169.254.169.254")]

    with pytest.raises(InvalidRequest) as info:
        await check_worker_url(
            "grpc://engine.internal:30000", HostAllowList(["engine.internal"]), resolve=metadata_service
        )
    assert "169.254.169.254" in info.value.message and info.value.code == "worker_url_not_allowed"
