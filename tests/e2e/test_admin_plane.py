"""The admin plane end to end: tenant keys never manage workers, worker URLs pass the host policy,
URL credentials never leak, --protect-metrics, and the separate admin listener."""

from __future__ import annotations

import logging

import httpx
import pytest

from harmony_gateway.sim import SimConfig
from tests.e2e._fleet import chat, next_request_id, served_by, sims
from tests.support.servers import running_gateway
from tests.support.servers import test_settings as gateway_settings

FAST = {"health_interval": 0.2, "health_timeout": 0.5}
TENANT_1, TENANT_2, ADMIN_KEY = "sk-tenant-1", "sk-tenant-2", "sk-admin"
KEYS = {"api_keys": frozenset({TENANT_1, TENANT_2}), "admin_keys": frozenset({ADMIN_KEY})}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def admin_routes(worker_url: str) -> list[tuple[str, str, dict[str, str] | None]]:
    return [
        ("GET", "/workers", None),
        ("POST", "/workers", {"url": worker_url, "kind": "regular"}),
        ("DELETE", "/workers/w1", None),
    ]


async def test_tenant_keys_cannot_manage_workers_or_reroute_other_tenants() -> None:
    async with sims(SimConfig(), SimConfig()) as engines:
        real, rogue = engines
        settings = gateway_settings(
            worker_urls=(real.url,), worker_allow_hosts=("127.0.0.1",), policy="round_robin", **FAST, **KEYS
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            for method, path, body in admin_routes(rogue.url):
                for headers, status in (({}, 401), (bearer("sk-unknown"), 401), (bearer(TENANT_2), 403)):
                    r = await http.request(method, path, json=body, headers=headers)
                    assert r.status_code == status, (method, path, headers, r.text)
                    error = r.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["type"] == ("permission_error" if status == 403 else "authentication_error")
            # Tenant 1's prompts still reach the real worker only; the rogue engine saw nothing.
            rids = [next_request_id("tenant1") for _ in range(4)]
            for rid in rids:
                assert (await chat(http, request_id=rid, headers=bearer(TENANT_1))).status_code == 200
            assert [served_by(rid, engines) for rid in rids] == [[0]] * 4
            assert rogue.requests == []
            listed = (await http.get("/workers", headers=bearer(ADMIN_KEY))).json()["data"]
            assert [w["url"] for w in listed] == [real.url]


async def test_worker_api_is_off_without_an_admin_credential() -> None:
    async with sims(SimConfig()) as (engine,):
        settings = gateway_settings(worker_urls=(engine.url,), **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            for method, path, body in admin_routes(engine.url):
                r = await http.request(method, path, json=body, headers=bearer("anything"))
                assert r.status_code == 403, r.text
                assert r.json()["error"]["code"] == "admin_plane_disabled"
                assert "--admin-key" in r.json()["error"]["message"]
            assert (await chat(http)).status_code == 200


@pytest.mark.parametrize(
    "url",
    ["http://169.254.169.254/latest/meta-data", "grpc://169.254.169.254:50051", "grpc://[fe80::1]:50051"],
)
async def test_metadata_and_link_local_worker_urls_are_refused_even_when_listed(url: str) -> None:
    async with sims(SimConfig()) as (engine,):
        listed = ("169.254.0.0/16", "fe80::/10", "127.0.0.1")
        settings = gateway_settings(worker_urls=(engine.url,), worker_allow_hosts=listed, **FAST, **KEYS)
        async with (
            running_gateway(settings) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10, headers=bearer(ADMIN_KEY)) as http,
        ):
            r = await http.post("/workers", json={"url": url})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "url" and error["code"] == "worker_url_not_allowed"
            assert "never a worker" in error["message"]
            assert [w["url"] for w in (await http.get("/workers")).json()["data"]] == [engine.url]


async def test_an_admin_registers_engines_on_private_and_loopback_addresses() -> None:
    """Without --worker-allow-hosts the admin key may name any engine but link-local and metadata ones:
    engines run on private networks."""
    async with sims(SimConfig()) as (engine,), sims(SimConfig()) as (loopback,):
        settings = gateway_settings(worker_urls=(engine.url,), policy="round_robin", **FAST, **KEYS)
        async with (
            running_gateway(settings) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10, headers=bearer(ADMIN_KEY)) as http,
        ):
            r = await http.post("/workers", json={"url": loopback.url})
            assert r.status_code == 201, r.text
            assert r.json()["healthy"] is True
            # Another loopback address, where nothing listens: registered all the same, not healthy.
            # (Private addresses are accepted alike: tests/routing/test_url_policy.py, with no traffic.)
            idle = loopback.url.replace("127.0.0.1", "127.0.0.2")
            other = await http.post("/workers", json={"url": idle})
            assert other.status_code == 201, other.text
            listed = {w["url"] for w in (await http.get("/workers")).json()["data"]}
            assert listed == {engine.url, loopback.url, idle}
            assert (await http.delete(f"/workers/{other.json()['id']}")).status_code == 200


async def test_worker_allow_hosts_narrows_the_hosts_an_admin_may_name() -> None:
    async with sims(SimConfig()) as (engine,), sims(SimConfig()) as (other,):
        settings = gateway_settings(
            worker_urls=(engine.url,), worker_allow_hosts=("127.0.0.1",), **FAST, **KEYS
        )
        async with (
            running_gateway(settings) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10, headers=bearer(ADMIN_KEY)) as http,
        ):
            # Refused before any connection is tried.
            for url in ("grpc://10.0.0.7:30000", other.url.replace("127.0.0.1", "127.0.0.2")):
                r = await http.post("/workers", json={"url": url})
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert error["param"] == "url" and error["code"] == "worker_url_not_allowed"
                assert "--worker-allow-hosts" in error["message"]
            assert (await http.post("/workers", json={"url": other.url})).status_code == 201


async def test_worker_url_credentials_never_leak(caplog: pytest.LogCaptureFixture) -> None:
    async with sims(SimConfig()) as (engine,):
        settings = gateway_settings(
            worker_urls=(engine.url,), worker_allow_hosts=("127.0.0.1",), log_level="debug", **FAST, **KEYS
        )
        async with sims(SimConfig()) as (gone,):
            dead_port = gone.url.rsplit(":", 1)[1]
        secret_url = f"http://admin:s3cr3t@127.0.0.1:{dead_port}"
        async with (
            running_gateway(settings) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10, headers=bearer(ADMIN_KEY)) as http,
        ):
            with caplog.at_level(logging.DEBUG, logger="harmony_gateway"):
                r = await http.post("/workers", json={"url": secret_url})
                assert r.status_code == 201, r.text
                assert r.json()["url"] == f"http://***@127.0.0.1:{dead_port}"
                duplicate = await http.post("/workers", json={"url": secret_url})
                assert duplicate.status_code == 409
                listed = await http.get("/workers")
                metrics = await http.get("/metrics")
                chats = [await chat(http, headers=bearer(TENANT_1)) for _ in range(2)]
            assert f"***@127.0.0.1:{dead_port}" in metrics.text  # the worker is there, its secret is not
            exposed = [r.text, duplicate.text, listed.text, metrics.text, *(c.text for c in chats)]
            exposed += [record.getMessage() for record in caplog.records]
            assert any(f"127.0.0.1:{dead_port}" in record.getMessage() for record in caplog.records)
            for text in exposed:
                assert "s3cr3t" not in text and "admin:" not in text
            # gRPC targets carry no credentials: one in a grpc:// URL is refused, never resolved or logged.
            refused = await http.post("/workers", json={"url": f"grpc://admin:s3cr3t@127.0.0.1:{dead_port}"})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "url"
            assert "s3cr3t" not in refused.text


async def test_protect_metrics_puts_metrics_and_docs_behind_the_admin_key() -> None:
    async with sims(SimConfig()) as (engine,):
        settings = gateway_settings(worker_urls=(engine.url,), protect_metrics=True, **FAST, **KEYS)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            for path in ("/metrics", "/docs", "/openapi.json"):
                assert (await http.get(path)).status_code == 401, path
                r = await http.get(path, headers=bearer(TENANT_1))
                assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", path
                assert (await http.get(path, headers=bearer(ADMIN_KEY))).status_code == 200, path
            metrics = await http.get("/metrics", headers=bearer(ADMIN_KEY))
            assert "harmony_gateway" in metrics.text or "worker" in metrics.text
            spec = (await http.get("/openapi.json", headers=bearer(ADMIN_KEY))).json()
            assert "/v1/chat/completions" in spec["paths"]
            assert (await http.get("/health")).status_code == 200  # probes stay open
        open_settings = gateway_settings(worker_urls=(engine.url,), **FAST, **KEYS)
        async with running_gateway(open_settings) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            for path in ("/metrics", "/docs", "/openapi.json"):
                assert (await http.get(path)).status_code == 200, path


async def test_admin_listener_serves_the_admin_routes_and_the_main_port_refuses_them() -> None:
    async with sims(SimConfig(), SimConfig()) as engines:
        first, second = engines
        settings = gateway_settings(
            worker_urls=(first.url,), admin_port=0, policy="round_robin", **FAST, **KEYS
        )
        async with running_gateway(settings) as gw:
            assert gw.admin_url is not None and gw.admin_url != gw.url
            async with (
                httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
                httpx.AsyncClient(base_url=gw.admin_url, timeout=10, headers=bearer(ADMIN_KEY)) as admin,
            ):
                # Even the admin key does not open the admin routes on the public port.
                for method, path, body in admin_routes(second.url):
                    r = await http.request(method, path, json=body, headers=bearer(ADMIN_KEY))
                    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_plane_elsewhere"
                # Admin keys are configured, so the listener asks for one as well.
                r = await admin.get("/workers", headers=bearer(TENANT_1))
                assert r.status_code == 403
                # The admin listener may register a loopback worker (operator network) ...
                r = await admin.post("/workers", json={"url": second.url})
                assert r.status_code == 201 and r.json()["healthy"] is True, r.text
                # ... but never the metadata service.
                r = await admin.post("/workers", json={"url": "grpc://169.254.169.254:50051"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "url"
                rids = [next_request_id("listener") for _ in range(4)]
                for rid in rids:
                    assert (await chat(http, request_id=rid, headers=bearer(TENANT_1))).status_code == 200
                assert sorted(served_by(rid, engines)[0] for rid in rids) == [0, 0, 1, 1]


async def test_admin_listener_without_admin_keys_is_the_credential() -> None:
    async with sims(SimConfig()) as (engine,):
        settings = gateway_settings(worker_urls=(engine.url,), admin_port=0, **FAST)
        async with running_gateway(settings) as gw:
            assert gw.admin_url is not None
            async with (
                httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
                httpx.AsyncClient(base_url=gw.admin_url, timeout=10) as admin,
            ):
                listed = (await admin.get("/workers")).json()["data"]
                assert [w["url"] for w in listed] == [engine.url]
                assert (await http.get("/workers")).status_code == 403
