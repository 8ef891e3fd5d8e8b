"""`--policy kv_aware` through the HTTP app on simulated engines: it serves and keeps prefixes on their
workers from its own record when no engine publishes KV events, follows a worker's prefix index over
that record when one does, leaves it under a heavy pushed load, and tells the inspector nothing of what
only the engine caches."""

from __future__ import annotations

import time
from typing import Any

import httpx

from harmony_gateway.engines.kv_events import EngineLoad
from harmony_gateway.routing import Worker
from harmony_gateway.sim import SimConfig
from tests.conftest import MODEL
from tests.e2e._fleet import all_workers_up, chat, next_request_id, served_by, sims
from tests.routing._fakes import BlockIndex
from tests.support.servers import RunningGateway, running_gateway
from tests.support.servers import test_settings as gateway_settings

FAST = {"health_interval": 0.2, "health_timeout": 0.5, "breaker_cooldown": 0.2}
DOCUMENTS = [
    " ".join(f"{topic} paragraph {i} with some distinct words" for i in range(60))
    for topic in ("astronomy", "botany", "chemistry", "geology")
]


def worker_by_url(gw: RunningGateway, url: str) -> Worker:
    return next(w for w in gw.state.fleet.all_workers() if w.url == url)


def heavy_load() -> EngineLoad:
    return EngineLoad(
        running_requests=30,
        waiting_requests=20,
        waiting_uncached_tokens=400_000,
        token_usage=0.5,
        active_token_usage=None,
        gen_throughput=0.0,
        max_running_requests=64,
        age_ms=0,
        sample=1,
        load_only=True,
    )


async def test_kv_aware_serves_and_keeps_prefixes_on_their_workers_without_events() -> None:
    """No engine publishes events: the policy's own record holds each document on its worker, and the
    gateway's in-flight count spreads new documents away from a busy worker."""
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(worker_urls=tuple(e.url for e in engines), policy="kv_aware", **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await all_workers_up(gw)
            homes: dict[int, set[int]] = {}

            async def ask(d: int, question: str) -> None:
                rid = next_request_id("kv")
                r = await chat(http, f"{DOCUMENTS[d]}\n\n{question}", request_id=rid)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"]
                homes.setdefault(d, set()).update(served_by(rid, engines))

            await ask(0, "Summarise it.")
            (first_home,) = homes[0]
            busy = worker_by_url(gw, engines[first_home].url)
            busy.in_flight += 3  # as if three long answers were streaming from it
            for d in range(1, len(DOCUMENTS)):
                await ask(d, "Summarise it.")
            busy.in_flight -= 3
            for question in ("List the topics.", "Count the paragraphs."):
                for d in range(len(DOCUMENTS)):
                    await ask(d, question)
    assert all(len(home) == 1 for home in homes.values()), homes
    assert homes[0] == {first_home} and homes[1] == homes[2] == homes[3] == {1 - first_home}


async def test_kv_aware_follows_the_engine_index_and_leaves_it_under_load() -> None:
    """Indexes and loads set by hand (the engines' own events are off here; tests/e2e/test_kv_fleet.py
    drives the same decisions through real event streams)."""
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(
            worker_urls=tuple(e.url for e in engines), policy="kv_aware", kv_events="off", **FAST
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await all_workers_up(gw)
            prompt = f"{DOCUMENTS[0]}\n\nSummarise it."
            first = next_request_id("kv")
            assert (await chat(http, prompt, request_id=first)).status_code == 200
            (was,) = served_by(first, engines)
            other = 1 - was
            prompt_ids = engines[was].requests[-1].input_ids
            # The engine that served it evicted it; the other engine announces it, never sent it by us.
            worker_by_url(gw, engines[was].url).kv_index = BlockIndex()
            holder = worker_by_url(gw, engines[other].url)
            holder.kv_index = BlockIndex().store(prompt_ids)
            body: dict[str, Any] = {"api": "chat", "request": {"model": MODEL, "messages": []}}
            body["request"]["messages"] = [{"role": "user", "content": prompt}]
            rendered = await http.post("/v1/harmony/render", json=body)
            assert rendered.status_code == 200, rendered.text
            # The inspector reports the record (the first request), not what the index says.
            assert rendered.json()["routing"]["cache_match_tokens"] == len(prompt_ids)
            for _ in range(3):
                rid = next_request_id("kv")
                assert (await chat(http, prompt, request_id=rid)).status_code == 200
                assert served_by(rid, engines) == [other]
            # A heavy load record from the holder sends the prompt back to the idle engine.
            holder.engine_load, holder.engine_load_at = heavy_load(), time.monotonic()
            rid = next_request_id("kv")
            assert (await chat(http, prompt, request_id=rid)).status_code == 200
            assert served_by(rid, engines) == [was]


async def test_the_inspector_shows_nothing_only_an_engine_caches() -> None:
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(
            worker_urls=tuple(e.url for e in engines), policy="kv_aware", kv_events="off", **FAST
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await all_workers_up(gw)
            assert (await chat(http, f"{DOCUMENTS[1]}\n\nSummarise it.")).status_code == 200
            prompt = f"{DOCUMENTS[2]}\n\nSummarise it."
            body = {
                "api": "chat",
                "request": {"model": MODEL, "messages": [{"role": "user", "content": prompt}]},
            }

            async def render() -> dict[str, Any]:
                rendered = await http.post("/v1/harmony/render", json=body)
                assert rendered.status_code == 200, rendered.text
                answer: dict[str, Any] = rendered.json()
                assert answer["routing"]["policy"] == "kv_aware"
                return answer

            before = await render()
            prompt_ids = before["token_ids"]
            shared_header = before["routing"]["cache_match_tokens"]
            assert 0 < shared_header < len(prompt_ids) // 4
            for engine in engines:
                worker_by_url(gw, engine.url).kv_index = BlockIndex().store(prompt_ids)
            assert (await render())["routing"]["cache_match_tokens"] == shared_header
            assert (await chat(http, prompt)).status_code == 200
            assert (await render())["routing"]["cache_match_tokens"] == len(prompt_ids)
