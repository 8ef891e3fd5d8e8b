"""Admission end to end: the cap, the queue, its timeout, clients leaving the queue, priorities."""

from __future__ import annotations

import asyncio

import httpx
import orjson

from tests.traffic._support import sim_and_gateway, stream_chat, until


def _assert_refused(status: int, headers: httpx.Headers, body: bytes, code: str) -> None:
    assert status == 429
    assert int(headers["retry-after"]) >= 1
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["type"] == "rate_limit_error"


async def test_two_in_flight_two_queued_two_refused() -> None:
    async with sim_and_gateway(max_concurrent_requests=2, queue_size=2) as (sim, gw):
        admission = gw.app.state.traffic.admission
        sim.hold()
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            tasks = [asyncio.create_task(stream_chat(http, f"request {i}")) for i in range(6)]
            await until(lambda: sum(t.done() for t in tasks) == 2)
            await until(lambda: sim.active_requests == 2 and admission.queued == 2)
            refused = [t.result() for t in tasks if t.done()]
            for status, headers, body in refused:
                _assert_refused(status, headers, body, "queue_full")
            sim.release_held()
            results = await asyncio.gather(*tasks)
            metrics = (await http.get("/metrics")).text
        served = [r for r in results if r[0] == 200]
        assert len(served) == 4
        for _, _, body in served:
            assert body.rstrip().endswith(b"data: [DONE]")
        assert sim.peak_active == 2
        assert admission.in_flight == 0 and admission.queued == 0
        assert 'gateway_admission_refused_total{reason="queue_full"} 2.0' in metrics


async def test_queued_request_times_out() -> None:
    async with sim_and_gateway(max_concurrent_requests=1, queue_size=2, queue_timeout=0.3) as (sim, gw):
        sim.hold()
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            first = asyncio.create_task(stream_chat(http, "first"))
            await until(lambda: sim.active_requests == 1)
            status, headers, body = await stream_chat(http, "second")
            _assert_refused(status, headers, body, "queue_timeout")
            sim.release_held()
            assert (await first)[0] == 200
        assert len(sim.requests) == 1


async def test_client_leaving_the_queue_frees_its_place() -> None:
    async with sim_and_gateway(max_concurrent_requests=1, queue_size=1) as (sim, gw):
        admission = gw.app.state.traffic.admission
        sim.hold()
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            first = asyncio.create_task(stream_chat(http, "first"))
            await until(lambda: sim.active_requests == 1)
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as leaving:
                queued = asyncio.create_task(stream_chat(leaving, "leaves"))
                await until(lambda: admission.queued == 1)
                status, headers, body = await stream_chat(http, "queue is full")
                _assert_refused(status, headers, body, "queue_full")
                queued.cancel()
            await until(lambda: admission.queued == 0)
            later = asyncio.create_task(stream_chat(http, "takes the place"))
            await until(lambda: admission.queued == 1)
            sim.release_held()
            assert (await first)[0] == 200
            assert (await later)[0] == 200
        assert admission.in_flight == 0
        # The request that left never reached the engine.
        assert len(sim.requests) == 2


async def test_higher_priority_waits_less(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from harmony_gateway.traffic.keys import KeyPolicy

    policies = {"low-key": KeyPolicy(), "high-key": KeyPolicy(priority=10)}
    async with sim_and_gateway(
        max_concurrent_requests=1, queue_size=4, api_keys=frozenset(policies), key_policies=policies
    ) as (sim, gw):
        admission = gw.app.state.traffic.admission
        sim.hold()
        done: list[str] = []
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:

            async def send(name: str, key: str) -> None:
                status, _, _ = await stream_chat(http, name, {"authorization": f"Bearer {key}"})
                assert status == 200
                done.append(name)

            tasks = [asyncio.create_task(send("running", "low-key"))]
            await until(lambda: sim.active_requests == 1)
            for i in range(3):
                tasks.append(asyncio.create_task(send(f"low {i}", "low-key")))
                await until(lambda i=i: admission.queued == i + 1)
            tasks.append(asyncio.create_task(send("high", "high-key")))
            await until(lambda: admission.queued == 4)
            sim.release_held()
            await asyncio.gather(*tasks)
        assert done == ["running", "high", "low 0", "low 1", "low 2"]


async def test_background_response_holds_its_slot_until_it_ends() -> None:
    from tests.conftest import MODEL

    async with sim_and_gateway(max_concurrent_requests=1, queue_size=1, queue_timeout=0.3) as (sim, gw):
        admission = gw.app.state.traffic.admission
        sim.hold()
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            r = await http.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True})
            assert r.status_code == 200 and r.json()["status"] in ("queued", "in_progress")
            await until(lambda: sim.active_requests == 1)
            assert admission.in_flight == 1  # the HTTP request returned; the response still runs
            status, headers, body = await stream_chat(http, "waits for the background response")
            _assert_refused(status, headers, body, "queue_timeout")
            sim.release_held()
            await until(lambda: admission.in_flight == 0)
            assert (await stream_chat(http, "now there is room"))[0] == 200
            stored = await http.get(f"/v1/responses/{r.json()['id']}")
            assert stored.json()["status"] == "completed"


async def test_the_cap_holds_across_gateway_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from harmony_gateway.sim import SimConfig, start_sim_engine
    from tests.support.processes import start_gateway_process

    async with await start_sim_engine(SimConfig(port=0)) as sim:
        gateway = await start_gateway_process(
            "--worker-url", sim.url, "--storage", f"sqlite:///{tmp_path}/r.db", "--workers", "2",
            "--max-concurrent-requests", "2", "--queue-size", "0",
        )  # fmt: skip
        try:
            sim.hold()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=30) as http:
                # One connection each: the processes share the listening socket and split them.
                tasks = [asyncio.create_task(stream_chat(http, f"request {i}")) for i in range(6)]
                await until(lambda: sum(t.done() for t in tasks) == 4)
                await until(lambda: sim.active_requests == 2)
                for task in [t for t in tasks if t.done()]:
                    _assert_refused(*task.result(), "queue_full")
                sim.release_held()
                results = await asyncio.gather(*tasks)
            assert sum(r[0] == 200 for r in results) == 2
            assert sim.peak_active == 2
        finally:
            gateway.stop()
