"""The worker management API end to end: list, add (probed before traffic), remove, errors, auth."""

from __future__ import annotations

import httpx

from harmony_gateway.sim import SimConfig
from tests.conftest import MODEL
from tests.e2e._fleet import chat, next_request_id, served_by, sims
from tests.support.servers import running_gateway
from tests.support.servers import test_settings as gateway_settings

FAST = {"health_interval": 0.2, "health_timeout": 0.5}
ADMIN_KEY = "sk-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
#: The admin plane, with the sim engines' loopback host allowed for registered workers.
ADMIN_PLANE = {"admin_keys": frozenset({ADMIN_KEY}), "worker_allow_hosts": ("127.0.0.1",)}


async def test_add_list_and_remove_workers() -> None:
    async with sims(SimConfig(), SimConfig(), SimConfig(engine="vllm")) as engines:
        first, second, third = engines
        settings = gateway_settings(worker_urls=(first.url,), policy="round_robin", **FAST, **ADMIN_PLANE)
        async with (
            running_gateway(settings) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10, headers=ADMIN) as http,
        ):
            listed = (await http.get("/workers")).json()["data"]
            assert [(w["url"], w["kind"], w["model"], w["healthy"]) for w in listed] == [
                (first.url, "regular", MODEL, True)
            ]
            r = await http.post("/workers", json={"url": second.url, "kind": "regular"})
            assert r.status_code == 201, r.text
            added = r.json()
            # Probed before the answer: the model is known and the worker is healthy at once.
            assert added["healthy"] is True and added["model"] == MODEL and added["engine"] == "sglang"
            assert set(added) == {
                "id",
                "url",
                "kind",
                "engine",
                "model",
                "healthy",
                "in_flight",
                "circuit_breaker",
                "draining",
                "discovered_by",
            }
            assert added["draining"] is False and added["discovered_by"] is None
            rids = [next_request_id("api") for _ in range(4)]
            for rid in rids:
                assert (await chat(http, request_id=rid)).status_code == 200
            assert sorted(served_by(rid, engines)[0] for rid in rids) == [0, 0, 1, 1]

            r = await http.post("/workers", json={"url": third.url})  # kind defaults to regular, engine auto
            assert r.status_code == 201 and r.json()["engine"] == "vllm" and r.json()["healthy"] is True
            assert len((await http.get("/workers")).json()["data"]) == 3

            r = await http.delete(f"/workers/{added['id']}")
            assert r.status_code == 200 and r.json()["deleted"] is True
            assert (await http.delete(f"/workers/{added['id']}")).status_code == 404
            before = len(second.requests)
            for _ in range(4):
                assert (await chat(http)).status_code == 200
            assert len(second.requests) == before
            assert [w["url"] for w in (await http.get("/workers")).json()["data"]] == [first.url, third.url]


async def test_add_worker_errors_and_unreachable_worker() -> None:
    async with sims(SimConfig()) as (engine,):
        async with sims(SimConfig()) as (gone,):
            dead_url = gone.url
        settings = gateway_settings(worker_urls=(engine.url,), **FAST, **ADMIN_PLANE)
        async with (
            running_gateway(settings) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10, headers=ADMIN) as http,
        ):
            r = await http.post("/workers", json={"url": engine.url, "kind": "regular"})
            assert r.status_code == 409 and r.json()["error"]["param"] == "url"
            r = await http.post("/workers", json={"url": "ftp://example.com:80"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "url"
            r = await http.post("/workers", json={"url": "grpc://no-port"})
            assert r.status_code == 400
            r = await http.post("/workers", json={"url": engine.url, "kind": "mixed"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "kind"
            r = await http.post("/workers", json={"kind": "regular"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "url"
            r = await http.post("/workers", json={"url": dead_url, "engine": "lmdeploy"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "engine"
            r = await http.post("/workers", json={"url": dead_url, "kind": "decode"})
            assert r.status_code == 201 and r.json()["healthy"] is False and r.json()["kind"] == "decode"
            assert len((await http.get("/workers")).json()["data"]) == 2
            assert (await chat(http)).status_code == 200  # the unreachable worker takes no traffic


async def test_worker_api_needs_the_admin_key_not_a_tenant_key() -> None:
    async with sims(SimConfig()) as (engine,):
        settings = gateway_settings(
            worker_urls=(engine.url,), api_keys=frozenset({"sk-tenant"}), **FAST, **ADMIN_PLANE
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            assert (await http.get("/workers")).status_code == 401
            assert (await http.post("/workers", json={"url": engine.url})).status_code == 401
            assert (await http.delete("/workers/w1")).status_code == 401
            tenant = {"authorization": "Bearer sk-tenant"}
            r = await http.get("/workers", headers=tenant)
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
            # The admin key is not a tenant key either.
            assert (await http.get("/v1/models", headers=ADMIN)).status_code == 401
            assert (await http.get("/workers", headers=ADMIN)).status_code == 200
            assert (await http.delete("/workers/nope", headers=ADMIN)).status_code == 404
            assert (await http.get("/metrics")).status_code == 200  # scrapes need no key by default


async def test_worker_changes_go_through_shared_storage_when_several_processes_serve(tmp_path) -> None:
    async with sims(SimConfig(), SimConfig()) as (first, second):
        settings = gateway_settings(
            worker_urls=(first.url,),
            processes=4,
            storage_url=f"sqlite:///{tmp_path / 'gw.db'}",
            **FAST,
            **ADMIN_PLANE,
        )
        async with (
            running_gateway(settings) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10, headers=ADMIN) as http,
        ):
            (static,) = (await http.get("/workers")).json()["data"]
            r = await http.post("/workers", json={"url": second.url, "kind": "regular"})
            assert r.status_code == 201, r.text
            added = r.json()
            # Ids are unique across processes, not a per-process counter.
            assert added["id"].startswith("w-") and added["healthy"] is True
            assert (await http.post("/workers", json={"url": second.url})).status_code == 409
            # Command-line workers are static in every process: deleting one here would not reach them.
            r = await http.delete(f"/workers/{static['id']}")
            assert r.status_code == 409 and r.json()["error"]["code"] == "worker_static", r.text
            listed = (await http.get("/workers")).json()["data"]
            assert [w["url"] for w in listed] == [first.url, second.url]
            r = await http.delete(f"/workers/{added['id']}")
            assert r.status_code == 200 and r.json()["deleted"] is True
            assert (await http.delete(f"/workers/{added['id']}")).status_code == 404
            assert [w["url"] for w in (await http.get("/workers")).json()["data"]] == [first.url]
            assert (await chat(http)).status_code == 200
