"""Several simulated engines behind one gateway: policies end to end, failover, PD dual dispatch."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx

from harmony_gateway.sim import SimConfig, start_sim_engine
from tests.e2e._fleet import answer_text, chat, next_request_id, served_by, sims
from tests.support.servers import running_gateway, wait_until
from tests.support.servers import test_settings as gateway_settings

FAST = {"health_interval": 0.2, "health_timeout": 0.5, "breaker_cooldown": 0.2}


def worker_by_url(gw, url: str):  # type: ignore[no-untyped-def]
    return next(w for w in gw.state.fleet.all_workers() if w.url == url)


async def test_round_robin_alternates() -> None:
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(worker_urls=tuple(e.url for e in engines), policy="round_robin", **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            order = []
            for _ in range(6):
                rid = next_request_id("rr")
                r = await chat(http, request_id=rid)
                assert r.status_code == 200, r.text
                (index,) = served_by(rid, engines)
                order.append(index)
    assert order in ([0, 1] * 3, [1, 0] * 3)


async def test_consistent_hash_pins_sessions() -> None:
    async with sims(SimConfig(), SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(
            worker_urls=tuple(e.url for e in engines), policy="consistent_hash", **FAST
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            homes: dict[str, set[int]] = {}
            for turn in range(3):
                for session in ("alice", "bob", "carol", "dave", "erin", "frank"):
                    rid = next_request_id("ch")
                    r = await chat(http, f"turn {turn}", request_id=rid, headers={"x-session-id": session})
                    assert r.status_code == 200, r.text
                    homes.setdefault(session, set()).update(served_by(rid, engines))
    assert all(len(home) == 1 for home in homes.values()), homes
    assert len(set().union(*homes.values())) > 1  # sessions are spread, not all on one worker


async def test_cache_aware_keeps_a_long_prefix_on_one_worker() -> None:
    documents = [
        " ".join(f"{topic} paragraph {i} with some distinct words" for i in range(60))
        for topic in ("astronomy", "botany", "chemistry", "geology")
    ]
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(worker_urls=tuple(e.url for e in engines), policy="cache_aware", **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            homes: dict[int, set[int]] = {}
            for question in ("Summarise it.", "List the topics.", "Count the paragraphs."):
                for d, document in enumerate(documents):
                    rid = next_request_id("ca")
                    r = await chat(http, f"{document}\n\n{question}", request_id=rid)
                    assert r.status_code == 200, r.text
                    homes.setdefault(d, set()).update(served_by(rid, engines))
    assert all(len(home) == 1 for home in homes.values()), homes
    assert len(set().union(*homes.values())) == 2  # different documents still use both workers


async def test_killed_worker_is_routed_around_and_returns_after_restart() -> None:
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(worker_urls=tuple(e.url for e in engines), policy="round_robin", **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            victim = engines[1]
            port = victim.port
            worker = worker_by_url(gw, victim.url)
            await wait_until(lambda: worker.healthy)
            await victim.stop()
            # Requests that had not started when the worker died never fail: they retry elsewhere.
            results = await asyncio.gather(*(chat(http) for _ in range(8)))
            assert [r.status_code for r in results] == [200] * 8, [
                r.text for r in results if r.status_code != 200
            ]
            await wait_until(lambda: not worker.healthy, timeout=5)
            results = [await chat(http) for _ in range(4)]
            assert all(r.status_code == 200 for r in results)
            before = len(engines[0].requests)
            assert before >= 12
            restarted = await start_sim_engine(SimConfig(port=port))
            try:
                await wait_until(lambda: worker.available(), timeout=15)
                rids = [next_request_id("back") for _ in range(4)]
                for rid in rids:
                    assert (await chat(http, request_id=rid)).status_code == 200
                assert sum(1 for r in restarted.requests if r.request_id in rids) == 2
            finally:
                await restarted.stop()


async def test_a_failure_after_tokens_is_reported_not_replayed() -> None:
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(worker_urls=tuple(e.url for e in engines), policy="round_robin", **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            for sim in engines:
                sim.fail_next(grpc.StatusCode.UNAVAILABLE, after_tokens=5)
            rid = next_request_id("mid")
            r = await chat(http, request_id=rid, stream=True)
            assert r.status_code == 200
            assert '"error"' in r.text and "data: [DONE]" in r.text
            assert len(served_by(rid, engines)) == 1  # never replayed on the other worker
            assert gw.state.metrics is not None


async def test_pd_shares_one_bootstrap_room_and_answers_from_decode() -> None:
    async with sims(SimConfig(mode="prefill", bootstrap_port=9123), SimConfig(mode="decode")) as (
        prefill,
        decode,
    ):
        settings = gateway_settings(prefill_urls=(prefill.url,), decode_urls=(decode.url,), **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await wait_until(lambda: gw.state.fleet.ready())
            for stream in (False, True):
                rid = next_request_id("pd")
                r = await chat(http, request_id=rid, stream=stream)
                assert r.status_code == 200, r.text
                assert "simulated answer" in answer_text(r)
                (p,) = [q for q in prefill.requests if q.request_id == rid]
                (d,) = [q for q in decode.requests if q.request_id == rid]
                assert p.bootstrap_room is not None and p.bootstrap_room == d.bootstrap_room
                assert p.bootstrap_host == d.bootstrap_host == "127.0.0.1"
                assert p.bootstrap_port == d.bootstrap_port == 9123  # learned from the prefill's server info
                assert p.input_ids == d.input_ids
            body = (await chat(http)).json()
            assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] > 0


async def test_pd_dead_prefill_fails_cleanly_and_aborts_decode() -> None:
    async with sims(SimConfig(mode="prefill"), SimConfig(mode="decode", ttft_ms=3000)) as (prefill, decode):
        settings = gateway_settings(
            prefill_urls=(prefill.url,), decode_urls=(decode.url,), max_retries=0, **FAST
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await wait_until(lambda: gw.state.fleet.ready())
            prefill.fail_next(grpc.StatusCode.INTERNAL, message="prefill crashed")
            rid = next_request_id("pdfail")
            started = time.monotonic()
            r = await chat(http, request_id=rid)
            assert time.monotonic() - started < 2.0  # decode would wait 3 s for its first token
            assert r.status_code >= 500 and r.json()["error"]["type"] == "server_error"
            await wait_until(lambda: rid in decode.aborted, timeout=2)
            await prefill.stop()
            r = await chat(http)
            assert r.status_code in (502, 503), r.text
            await wait_until(lambda: not gw.state.fleet.ready(), timeout=5)
            r = await chat(http)
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
