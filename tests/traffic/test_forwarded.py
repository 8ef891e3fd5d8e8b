"""`X-Forwarded-For` is believed only from the peers in `--forwarded-allow-ips` (default: none), in a real
`serve` process, one or several (`--workers N`): a local client cannot pick its address to escape a
per-address budget, and a trusted proxy's forwarded address is honoured."""

from __future__ import annotations

import httpx
import pytest

from harmony_gateway.api.http_protocol import server_options
from harmony_gateway.cli import build_parser, invalid_setting, settings_from_args
from harmony_gateway.sim import SimConfig, start_sim_engine
from tests.support.processes import start_gateway_process
from tests.traffic._support import REDIS_URL, chat_body, redis_keys, require_redis  # noqa: F401  (a fixture)


async def _statuses(base_url: str, forwarded_for: list[str]) -> list[int]:
    """One chat per entry, each claiming to be forwarded for that address."""
    out = []
    async with httpx.AsyncClient(timeout=30) as http:
        for address in forwarded_for:
            r = await http.post(
                base_url + "/chat/completions",
                json=chat_body(stream=False),
                headers={"x-forwarded-for": address},
            )
            out.append(r.status_code)
    return out


def _settings(*args: str):  # type: ignore[no-untyped-def]
    return settings_from_args(build_parser().parse_args(["serve", *args]))


def test_forwarded_headers_are_off_unless_peers_are_named() -> None:
    default = server_options(_settings())
    assert default["proxy_headers"] is False
    trusted = server_options(
        _settings("--forwarded-allow-ips", "10.0.0.0/8, 192.168.1.7", "--forwarded-allow-ips", "*")
    )
    assert trusted["proxy_headers"] is True
    assert trusted["forwarded_allow_ips"] == ["10.0.0.0/8", "192.168.1.7", "*"]
    assert "--forwarded-allow-ips" in (
        invalid_setting(_settings("--forwarded-allow-ips", "proxy.local")) or ""
    )
    assert invalid_setting(_settings("--forwarded-allow-ips", "::1,127.0.0.1/32")) is None


@pytest.mark.parametrize(
    ("trusted", "expected"),
    [
        ((), [200, 429]),  # the forwarded address is ignored: both requests are 127.0.0.1's
        (("--forwarded-allow-ips", "127.0.0.1"), [200, 200, 429]),
    ],
    ids=["default", "trusted-peer"],
)
async def test_per_address_limit_and_forwarded_for(trusted: tuple[str, ...], expected: list[int]) -> None:
    addresses = ["203.0.113.1", "203.0.113.2", "203.0.113.2"][: len(expected)]
    async with await start_sim_engine(SimConfig(port=0)) as sim:
        gateway = await start_gateway_process(
            "--worker-url", sim.url, "--storage", "memory://", "--rate-limit", "1", *trusted
        )
        try:
            assert await _statuses(gateway.base_url, addresses) == expected
        finally:
            gateway.stop()


@pytest.mark.usefixtures("require_redis")
async def test_several_processes_ignore_forwarded_for_by_default(tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with redis_keys(), await start_sim_engine(SimConfig(port=0)) as sim:
        gateway = await start_gateway_process(
            "--worker-url", sim.url, "--storage", f"sqlite:///{tmp_path}/gateway.db", "--workers", "2",
            "--rate-limit", "1", "--rate-limit-store", REDIS_URL,
        )  # fmt: skip
        try:
            statuses = await _statuses(gateway.base_url, ["203.0.113.1", "203.0.113.2", "203.0.113.3"])
        finally:
            gateway.stop()
    assert statuses == [200, 429, 429]
