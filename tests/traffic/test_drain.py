"""SIGTERM drain end to end: a real gateway process with ten streams held open at the engine."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any
from unittest.mock import ANY

import httpx
import pytest

from harmony_gateway.sim import SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.processes import start_gateway_process
from tests.traffic._support import chat_body, sim_and_gateway, until


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
            # Numbered by the framer's own counter: right after the last event the client got.
            assert len(events) >= 2 and last["sequence_number"] == events[-2]["sequence_number"] + 1
            seqs = [e["sequence_number"] for e in events]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            assert await _wait_exit(gateway.proc) == 0
            await until(lambda: len(sim.aborted) == 1)
        finally:
            gateway.kill()


# -- in process: the cut of each kind of stream, at a moment the test chooses ------------------------------
LONG = "think hard [[long]]"


async def _events_until_cut(
    http: httpx.AsyncClient, control: Any, method: str, path: str, **kwargs: Any
) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of the stream at `path`; the gateway's drain cuts it (timeout 0)
    once three events arrived."""
    events: list[tuple[str, dict[str, Any]]] = []
    name = ""
    async with http.stream(method, path, **kwargs) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                if len(events) == 3:
                    assert not await control.drain(0)
    return events


def _assert_numbered_cut(events: list[tuple[str, dict[str, Any]]]) -> None:
    name, last = events[-1]
    assert name == "error" and last["type"] == "error" and last["code"] == "shutting_down"
    assert len(events) > 3 and last["sequence_number"] == events[-2][1]["sequence_number"] + 1
    assert all(data["type"] != "response.completed" for _, data in events)


@pytest.mark.parametrize("follow", ["post", "get"])
async def test_a_cut_background_stream_ends_with_an_error_event_after_its_last_event(follow: str) -> None:
    # A background response's stream replays and follows its event log (responses/events.py), numbered
    # as the log is; a reader that joins late starts after `starting_after`.
    async with sim_and_gateway(SimConfig(port=0, tokens_per_second=20)) as (_, gw):
        control = gw.app.state.traffic
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            body = {"model": MODEL, "input": LONG, "background": True}
            if follow == "post":
                events = await _events_until_cut(
                    http, control, "POST", "/v1/responses", json=dict(body, stream=True)
                )
            else:
                created = await http.post("/v1/responses", json=body)
                assert created.status_code == 200
                events = await _events_until_cut(
                    http,
                    control,
                    "GET",
                    f"/v1/responses/{created.json()['id']}",
                    params={"stream": "true", "starting_after": "0"},
                )
                assert events[0][1]["sequence_number"] == 1
    _assert_numbered_cut(events)


async def test_a_cut_responses_stream_ends_with_an_error_event_after_its_last_event() -> None:
    async with sim_and_gateway(SimConfig(port=0, tokens_per_second=20)) as (sim, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            events = await _events_until_cut(
                http,
                gw.app.state.traffic,
                "POST",
                "/v1/responses",
                json={"model": MODEL, "input": LONG, "stream": True},
            )
        _assert_numbered_cut(events)
        await until(lambda: len(sim.aborted) == 1)


async def test_a_cut_messages_stream_ends_with_an_overloaded_error_event() -> None:
    async with sim_and_gateway(SimConfig(port=0, tokens_per_second=20)) as (sim, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            body = {
                "model": MODEL,
                "max_tokens": 4000,
                "messages": [{"role": "user", "content": LONG}],
                "stream": True,
            }
            events = await _events_until_cut(http, gw.app.state.traffic, "POST", "/v1/messages", json=body)
        assert events[-1] == (
            "error",
            {"type": "error", "error": {"type": "overloaded_error", "message": ANY}},
        )
        assert all(name != "message_stop" for name, _ in events)
        await until(lambda: len(sim.aborted) == 1)
