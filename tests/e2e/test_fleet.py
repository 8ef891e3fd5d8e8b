"""Several simulated engines behind one gateway: policies end to end, failover, PD dual dispatch."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import httpx

from harmony_gateway.sim import SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.e2e._fleet import all_workers_up, answer_text, chat, next_request_id, served_by, sims
from tests.support.servers import client_request_id, client_request_ids, running_gateway, wait_until
from tests.support.servers import test_settings as gateway_settings

FAST = {"health_interval": 0.2, "health_timeout": 0.5, "breaker_cooldown": 0.2}


def worker_by_url(gw, url: str):  # type: ignore[no-untyped-def]
    return next(w for w in gw.state.fleet.all_workers() if w.url == url)


async def test_round_robin_alternates() -> None:
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(worker_urls=tuple(e.url for e in engines), policy="round_robin", **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await all_workers_up(gw)
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
            await all_workers_up(gw)
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
            await all_workers_up(gw)
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
            await all_workers_up(gw)
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
                assert sum(1 for r in restarted.requests if client_request_id(r.request_id) in rids) == 2
            finally:
                await restarted.stop()


async def test_a_failure_after_tokens_is_reported_not_replayed() -> None:
    async with sims(SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(worker_urls=tuple(e.url for e in engines), policy="round_robin", **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await all_workers_up(gw)
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
            await all_workers_up(gw)
            await wait_until(lambda: gw.state.fleet.ready())
            for stream in (False, True):
                rid = next_request_id("pd")
                r = await chat(http, request_id=rid, stream=stream)
                assert r.status_code == 200, r.text
                assert "simulated answer" in answer_text(r)
                (p,) = [q for q in prefill.requests if client_request_id(q.request_id) == rid]
                (d,) = [q for q in decode.requests if client_request_id(q.request_id) == rid]
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
            await wait_until(lambda: rid in client_request_ids(decode.aborted), timeout=2)
            await prefill.stop()
            r = await chat(http)
            assert r.status_code in (502, 503), r.text
            await wait_until(lambda: not gw.state.fleet.ready(), timeout=5)
            r = await chat(http)
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


async def test_rejected_requests_do_not_open_the_breaker() -> None:
    async with sims(SimConfig()) as engines:
        (engine,) = engines
        settings = gateway_settings(
            worker_urls=(engine.url,), breaker_failure_threshold=2, **{**FAST, "breaker_cooldown": 60}
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await all_workers_up(gw)
            worker = worker_by_url(gw, engine.url)
            for _ in range(4):
                engine.fail_next(grpc.StatusCode.INVALID_ARGUMENT, message="bad request")
                r = await chat(http)
                assert r.status_code == 400, r.text
            # The client's mistakes say nothing about the worker: it keeps serving everyone.
            assert worker.breaker.value == "closed" and worker.breaker_failures == 0
            assert (await chat(http)).status_code == 200
            # A failure that does blame the worker still counts.
            engine.fail_next(grpc.StatusCode.INTERNAL, message="engine crashed")
            assert (await chat(http)).status_code == 502
            assert worker.breaker_failures == 1


async def test_random_and_power_of_two_spread_requests() -> None:
    async with sims(SimConfig(), SimConfig(), SimConfig()) as engines:
        for policy in ("random", "power_of_two"):
            settings = gateway_settings(worker_urls=tuple(e.url for e in engines), policy=policy, **FAST)
            async with (
                running_gateway(settings) as gw,
                httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
            ):
                rids = [next_request_id(policy) for _ in range(15)]
                results = await asyncio.gather(*(chat(http, request_id=rid) for rid in rids))
                assert all(r.status_code == 200 for r in results)
                used = {i for rid in rids for i in served_by(rid, engines)}
            assert len(used) >= 2, (policy, used)


async def test_consistent_hash_pins_chat_users_and_spreads_them() -> None:
    async with sims(SimConfig(), SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(
            worker_urls=tuple(e.url for e in engines), policy="consistent_hash", **FAST
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await all_workers_up(gw)
            homes: dict[str, set[int]] = {}
            for turn in range(3):
                for user in ("ann", "ben", "cat", "dan", "eve", "fay", "gus", "hal"):
                    rid = next_request_id("user")
                    r = await chat(http, f"turn {turn}", request_id=rid, user=user)
                    assert r.status_code == 200, r.text
                    homes.setdefault(user, set()).update(served_by(rid, engines))
    assert all(len(home) == 1 for home in homes.values()), homes
    assert len(set().union(*homes.values())) > 1


async def test_consistent_hash_keeps_a_previous_response_chain_on_one_worker() -> None:
    async with sims(SimConfig(), SimConfig(), SimConfig()) as engines:
        settings = gateway_settings(
            worker_urls=tuple(e.url for e in engines), policy="consistent_hash", **FAST
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await all_workers_up(gw)
            homes: list[set[int]] = []
            for chain in range(5):
                home: set[int] = set()
                previous = None
                for turn in range(3):
                    rid = next_request_id("chain")
                    body = {"model": MODEL, "input": f"chain {chain} turn {turn}"}
                    if previous is not None:
                        body["previous_response_id"] = previous
                    r = await http.post("/v1/responses", json=body, headers={"x-request-id": rid})
                    assert r.status_code == 200, r.text
                    previous = r.json()["id"]
                    home.update(served_by(rid, engines))
                homes.append(home)
            # A session header still wins over the chain.
            rid = next_request_id("chain")
            sessions = {}
            for session in ("s1", "s2", "s3"):
                r = await http.post(
                    "/v1/responses",
                    json={"model": MODEL, "input": "hi", "previous_response_id": previous},
                    headers={"x-request-id": rid + session, "x-session-id": session},
                )
                assert r.status_code == 200, r.text
                sessions[session] = served_by(rid + session, engines)
                r = await chat(http, request_id=rid + session + "c", headers={"x-session-id": session})
                assert served_by(rid + session + "c", engines) == sessions[session]
    assert all(len(home) == 1 for home in homes), homes


async def test_cache_aware_moves_a_cached_prefix_to_the_least_loaded_worker_under_skew() -> None:
    document = " ".join(f"geology paragraph {i} with some distinct words" for i in range(60))
    slow = SimConfig(tokens_per_second=5, output_tokens=400)
    async with sims(slow, slow) as engines:
        settings = gateway_settings(
            worker_urls=tuple(e.url for e in engines),
            policy="cache_aware",
            balance_abs_threshold=2,
            balance_rel_threshold=1.5,
            **FAST,
        )
        async with (
            running_gateway(settings) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
            contextlib.AsyncExitStack() as streams,
        ):
            homes = []
            for _ in range(5):
                rid = next_request_id("skew")
                payload = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": document}],
                    "stream": True,
                }
                r = await streams.enter_async_context(
                    http.stream("POST", "/v1/chat/completions", json=payload, headers={"x-request-id": rid})
                )
                assert r.status_code == 200  # headers follow the first token: the request is in flight
                (home,) = served_by(rid, engines)
                homes.append(home)
            busy = homes[0]
            # The cached prefix wins while the gap is within 2 requests; the 4th new request (3 in flight
            # against 0) goes to the idle worker although its prefix is cached on the busy one.
            assert homes[:4] == [busy, busy, busy, 1 - busy], homes


async def test_harmony_models_turns_on_harmony_for_a_model_not_reported_as_gpt_oss() -> None:
    name = "acme/finetune-7b"
    async with sims(SimConfig(model=name, reports_gpt_oss=False)) as (engine,):
        plain = gateway_settings(worker_urls=(engine.url,), **FAST)
        async with running_gateway(plain) as gw:
            await wait_until(lambda: name in gw.state.fleet.groups)
            assert gw.state.fleet.groups[name].harmony is False
        settings = gateway_settings(worker_urls=(engine.url,), harmony_models=frozenset({name}), **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await all_workers_up(gw)
            await wait_until(lambda: name in gw.state.fleet.groups)
            assert gw.state.fleet.groups[name].harmony is True
            r = await chat(http, model=name)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            assert "simulated answer" in message["content"] and message["reasoning_content"]
            assert engine.requests[-1].sampling["stop_token_ids"] == [200002, 200012]


async def test_sampling_reaches_the_sglang_engine_exactly() -> None:
    async with sims(SimConfig()) as (engine,):
        settings = gateway_settings(worker_urls=(engine.url,), **FAST)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            await all_workers_up(gw)
            r = await chat(
                http,
                temperature=0.25,
                top_p=0.5,
                top_k=20,
                min_p=0.125,
                repetition_penalty=1.5,
                n=2,
                max_completion_tokens=64,
                stop_token_ids=[7, 9],
            )
            assert r.status_code == 200, r.text
            sent = engine.requests[-1].sampling
            assert (sent["temperature"], sent["top_p"], sent["min_p"]) == (0.25, 0.5, 0.125)
            assert sent["top_k"] == 20
            assert (sent["repetition_penalty"], sent["n"], sent["max_new_tokens"]) == (1.5, 2, 64)
            assert set(sent["stop_token_ids"]) == {7, 9, 200002, 200012}

            r = await chat(http)
            assert r.status_code == 200, r.text
            sent = engine.requests[-1].sampling
            prompt = len(engine.requests[-1].input_ids)
            # proto3 leaves zeros off the wire, so an absent min_p is the explicit 0.
            assert (sent["temperature"], sent["top_p"], sent["top_k"], sent.get("min_p", 0)) == (1, 1, -1, 0)
            assert (sent["repetition_penalty"], sent["n"]) == (1, 1)
            assert sent["max_new_tokens"] == 131072 - prompt
            assert sent["stop_token_ids"] == [200002, 200012]
