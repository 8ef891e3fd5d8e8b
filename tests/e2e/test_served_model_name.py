"""`--served-model-name`: clients use the gateway's name for the model, whatever the engines report."""

from __future__ import annotations

import httpx

from harmony_gateway.sim import SimConfig
from tests.e2e._fleet import chat, sims
from tests.support.servers import running_gateway, test_settings, wait_until


async def test_clients_use_the_served_name() -> None:
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = test_settings(worker_urls=tuple(e.url for e in engines), served_model_name="gpt-oss")
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            fleet = gw.state.fleet
            await wait_until(lambda: "gpt-oss" in fleet.groups and len(fleet.groups["gpt-oss"].workers) == 2)
            models = (await http.get("/v1/models")).json()["data"]
            assert [m["id"] for m in models] == ["gpt-oss"]
            r = await chat(http, model="gpt-oss")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "gpt-oss"
            assert (await chat(http, model="openai/gpt-oss-20b")).status_code == 404
