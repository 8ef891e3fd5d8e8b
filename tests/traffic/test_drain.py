"""SIGTERM drain end to end: a real gateway process with ten streams held open at the engine."""

from __future__ import annotations

import asyncio
import signal

import httpx

from harmony_gateway.sim import SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.processes import start_gateway_process
from tests.traffic._support import chat_body, until


async def _wait_exit(proc, timeout: float = 30.0) -> int:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while proc.poll() is None:
        assert asyncio.get_running_loop().time() < deadline, "the gateway did not exit"
        await asyncio.sleep(0.05)
    return int(proc.returncode)


async def _until_not_ready(http: httpx.AsyncClient, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (await http.get("/readiness")).status_code != 503:
        assert asyncio.get_running_loop().time() < deadline, "/readiness never answered 503"
        await asyncio.sleep(0.02)


async def test_sigterm_drains_streams_refuses_new_requests_and_exits_0() -> None:
    async with await start_sim_engine(SimConfig(port=0)) as sim:
        gateway = await start_gateway_process("--worker-url", sim.url, "--storage", "memory://")
        try:
            sim.hold()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=60) as http:

                async def stream(i: int) -> bytes:
                    async with http.stream("POST", "/v1/chat/completions", json=chat_body(f"s {i}")) as r:
                        assert r.status_code == 200
                        return await r.aread()

                streams = [asyncio.create_task(stream(i)) for i in range(10)]
                await until(lambda: sim.active_requests == 10)
                gateway.proc.send_signal(signal.SIGTERM)

                await _until_not_ready(http)
                refused = await http.post("/v1/chat/completions", json=chat_body(stream=False))
                assert refused.status_code == 503
                assert int(refused.headers["retry-after"]) >= 1
                assert refused.json()["error"]["code"] == "shutting_down"
                sim.release_held()
                bodies = await asyncio.gather(*streams)
            for body in bodies:
                assert b'"finish_reason":"stop"' in body
                assert body.rstrip().endswith(b"data: [DONE]")
            assert await _wait_exit(gateway.proc) == 0
            assert not sim.aborted
        finally:
            gateway.kill()


async def test_drain_timeout_ends_streams_with_an_error_event() -> None:
    # A long answer paced at 20 tokens/s outlasts the 0.5 s drain timeout by far.
    async with await start_sim_engine(SimConfig(port=0, tokens_per_second=20)) as sim:
        gateway = await start_gateway_process(
            "--worker-url", sim.url, "--storage", "memory://", "--drain-timeout", "0.5"
        )
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=60) as http:
                body = b""
                async with http.stream(
                    "POST", "/v1/chat/completions", json=chat_body("think hard [[long]]")
                ) as r:
                    assert r.status_code == 200
                    async for piece in r.aiter_bytes():
                        if not body:
                            gateway.proc.send_signal(signal.SIGTERM)  # the stream has started
                        body += piece
            assert b'"code":"shutting_down"' in body
            assert body.rstrip().endswith(b"data: [DONE]")
            assert b'"finish_reason":"stop"' not in body
            assert await _wait_exit(gateway.proc) == 0
            await until(lambda: len(sim.aborted) == 1)
        finally:
            gateway.kill()


async def test_every_gateway_process_drains(tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with await start_sim_engine(SimConfig(port=0)) as sim:
        gateway = await start_gateway_process(
            "--worker-url", sim.url, "--storage", f"sqlite:///{tmp_path}/r.db", "--workers", "2"
        )
        try:
            sim.hold()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=60) as http:

                async def stream(i: int) -> bytes:
                    async with http.stream("POST", "/v1/chat/completions", json=chat_body(f"s {i}")) as r:
                        assert r.status_code == 200
                        return await r.aread()

                streams = [asyncio.create_task(stream(i)) for i in range(6)]
                await until(lambda: sim.active_requests == 6)
                gateway.proc.send_signal(signal.SIGTERM)
                # The supervisor passes SIGTERM on when its own loop next looks (every 0.5 s or more).
                await _until_not_ready(http)
                refused = await http.post("/v1/chat/completions", json=chat_body(stream=False))
                assert refused.status_code == 503
                sim.release_held()
                bodies = await asyncio.gather(*streams)
            for body in bodies:
                assert body.rstrip().endswith(b"data: [DONE]")
            assert await _wait_exit(gateway.proc) == 0
        finally:
            gateway.kill()


async def test_drain_timeout_ends_a_responses_stream_with_an_error_event() -> None:
    import json

    async with await start_sim_engine(SimConfig(port=0, tokens_per_second=20)) as sim:
        gateway = await start_gateway_process(
            "--worker-url", sim.url, "--storage", "memory://", "--drain-timeout", "0.5"
        )
        try:
            events = []
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.port}", timeout=60) as http:
                body = {"model": MODEL, "input": "think hard [[long]]", "stream": True}
                async with http.stream("POST", "/v1/responses", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            if not events:
                                gateway.proc.send_signal(signal.SIGTERM)  # the stream has started
                            events.append(json.loads(line[6:]))
            last = events[-1]
            assert last["type"] == "error" and last["code"] == "shutting_down" and last["message"]
            seqs = [e["sequence_number"] for e in events]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            assert await _wait_exit(gateway.proc) == 0
            await until(lambda: len(sim.aborted) == 1)
        finally:
            gateway.kill()
