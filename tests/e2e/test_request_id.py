"""Request ids: honoured, generated when missing, returned, used as the engine request id, and logged."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest

from harmony_gateway.observability.logging import JsonFormatter
from harmony_gateway.sim import SimConfig
from tests.e2e._fleet import chat, sims
from tests.support.servers import client_request_id, running_gateway, wait_until
from tests.support.servers import test_settings as gateway_settings

SECRET = "my secret prompt text"


@pytest.mark.parametrize("log_prompts", [False, True])
async def test_request_id_reaches_the_engine_and_the_log(
    log_prompts: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async with sims(SimConfig()) as (engine,):
        settings = gateway_settings(worker_urls=(engine.url,), log_prompts=log_prompts)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            with caplog.at_level(logging.INFO, logger="harmony_gateway.requests"):
                r = await chat(http, SECRET, request_id="client-chosen-id")
                assert r.status_code == 200 and r.headers["x-request-id"] == "client-chosen-id"
                # The engine sees the gateway's own id, made from the client's (engine logs correlate).
                engine_id = engine.requests[-1].request_id
                assert engine_id != "client-chosen-id" and client_request_id(engine_id) == "client-chosen-id"
                body = {"model": "openai/gpt-oss-20b", "messages": [{"role": "user", "content": SECRET}]}
                r = await http.post("/v1/chat/completions", json={**body, "stream": True})
                generated = r.headers["x-request-id"]
                assert len(generated) >= 16 and client_request_id(engine.requests[-1].request_id) == generated
    records = [rec for rec in caplog.records if rec.name == "harmony_gateway.requests"]
    assert len(records) == 2
    line = orjson.loads(JsonFormatter().format(records[0]))
    assert line["request_id"] == "client-chosen-id" and line["status"] == 200
    assert line["worker"] == engine.url and line["model"] == "openai/gpt-oss-20b"
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] > 0 and line["latency_ms"] > 0
    assert f"worker={engine.url}" in records[0].getMessage()
    streamed = orjson.loads(JsonFormatter().format(records[1]))
    assert streamed["request_id"] == generated and streamed["completion_tokens"] > 0
    assert (SECRET in repr(line)) is log_prompts


@pytest.mark.parametrize("log_prompts", [False, True])
async def test_log_prompts_covers_every_generating_route(
    log_prompts: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """`--log-prompts` puts the prompt of Responses, /generate and completions requests in their log line
    (as it does for chat and messages); without it no prompt text is logged."""
    async with sims(SimConfig()) as (engine,):
        settings = gateway_settings(worker_urls=(engine.url,), log_prompts=log_prompts)
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            with caplog.at_level(logging.INFO, logger="harmony_gateway.requests"):
                model = "openai/gpt-oss-20b"
                requests = [
                    ("/v1/responses", {"model": model, "input": SECRET, "instructions": "be " + SECRET}),
                    ("/v1/responses", {"model": model, "input": [{"role": "user", "content": SECRET}]}),
                    ("/v1/responses", {"model": model, "input": SECRET, "stream": True}),
                    ("/v1/completions", {"model": model, "prompt": SECRET, "max_tokens": 5}),
                    ("/generate", {"text": SECRET, "sampling_params": {"max_new_tokens": 5}}),
                ]
                for path, body in requests:
                    r = await http.post(path, json=body)
                    assert r.status_code == 200, r.text
    records = [rec for rec in caplog.records if rec.name == "harmony_gateway.requests"]
    assert [orjson.loads(JsonFormatter().format(rec))["route"] for rec in records] == [
        "responses",
        "responses",
        "responses",
        "completions",
        "generate",
    ]
    for record in records:
        assert (SECRET in JsonFormatter().format(record)) is log_prompts


async def test_missing_and_wrong_keys_are_401_with_a_request_id(sim) -> None:
    settings = gateway_settings(worker_urls=(sim.url,), api_keys=frozenset({"right"}))
    async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        body = {"model": "openai/gpt-oss-20b", "messages": [{"role": "user", "content": "hi"}]}
        missing = await http.post("/v1/chat/completions", json=body, headers={"x-request-id": "rid-401"})
        assert missing.status_code == 401
        assert missing.headers["x-request-id"] == "rid-401"
        assert missing.json()["error"]["type"] == "authentication_error"
        wrong = await http.post(
            "/v1/responses", json={"model": "m", "input": "x"}, headers={"authorization": "Bearer no"}
        )
        assert wrong.status_code == 401 and wrong.headers["x-request-id"]
        ok = await http.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer right"})
        assert ok.status_code == 200


TENANT_A, TENANT_B = "sk-tenant-a", "sk-tenant-b"
LONG_CHAT = {"model": "openai/gpt-oss-20b", "messages": [{"role": "user", "content": "[[long]] tell me"}]}


@pytest.mark.parametrize("a_route", ["chat", "responses"])
async def test_a_client_request_id_never_names_another_tenants_engine_request(a_route: str) -> None:
    """Tenant B streams with id X and hangs up while tenant A's request with the same id X runs: B's
    engine request is aborted, A's runs to its end (before, the gateway aborted X, A's answer ended
    empty with finish_reason stop, or was stored completed with no output)."""
    async with sims(SimConfig(tokens_per_second=300)) as (engine,):
        settings = gateway_settings(worker_urls=(engine.url,), api_keys=frozenset({TENANT_A, TENANT_B}))
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            shared = {"x-request-id": "same-id-for-both"}
            as_b = {**shared, "authorization": f"Bearer {TENANT_B}"}
            as_a = {**shared, "authorization": f"Bearer {TENANT_A}"}
            async with http.stream(
                "POST", "/v1/chat/completions", json={**LONG_CHAT, "stream": True}, headers=as_b
            ) as b_stream:
                assert b_stream.status_code == 200
                lines = b_stream.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                if a_route == "chat":
                    a_call = http.post("/v1/chat/completions", json=LONG_CHAT, headers=as_a)
                else:
                    body = {"model": LONG_CHAT["model"], "input": "[[long]] tell me", "store": True}
                    a_call = http.post("/v1/responses", json=body, headers=as_a)
                a_task = asyncio.create_task(a_call)
                await wait_until(lambda: engine.active_requests == 2, timeout=10)
            # B has hung up: exactly its own engine request is aborted.
            await wait_until(lambda: len(engine.aborted) == 1, timeout=10)
            b_engine_id, a_engine_id = (r.request_id for r in engine.requests[-2:])
            assert engine.aborted == [b_engine_id] and a_engine_id != b_engine_id
            a_answer = await a_task
            assert a_answer.status_code == 200, a_answer.text
            assert a_answer.headers["x-request-id"] == "same-id-for-both"
            if a_route == "chat":
                choice = a_answer.json()["choices"][0]
                assert choice["finish_reason"] == "stop" and choice["message"]["content"]
            else:
                stored = (await http.get(f"/v1/responses/{a_answer.json()['id']}", headers=as_a)).json()
                assert stored["status"] == "completed"
                assert [item["type"] for item in stored["output"]] == ["reasoning", "message"]


@pytest.mark.parametrize(
    "client_id",
    ["x" * 129, "semi;colon", 'quote"s', "spa ce", "tilde~id", "\u00e9t\u00e9"],
)
async def test_a_malformed_client_request_id_is_replaced_before_it_is_logged(
    client_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with sims(SimConfig()) as (engine,):
        settings = gateway_settings(worker_urls=(engine.url,))
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            with caplog.at_level(logging.INFO, logger="harmony_gateway.requests"):
                r = await http.post(
                    "/v1/chat/completions", json=LONG_CHAT, headers={"x-request-id": client_id.encode()}
                )
    assert r.status_code == 200
    fresh = r.headers["x-request-id"]
    assert fresh != client_id and len(fresh) == 24 and fresh.isalnum()
    [record] = [rec for rec in caplog.records if rec.name == "harmony_gateway.requests"]
    assert orjson.loads(JsonFormatter().format(record))["request_id"] == fresh
    assert client_id not in JsonFormatter().format(record)


async def test_the_longest_well_formed_client_request_id_is_kept() -> None:
    client_id = "a-Z_0.9:/+=@" + "k" * 116
    async with sims(SimConfig()) as (engine,):
        async with running_gateway(gateway_settings(worker_urls=(engine.url,))) as gw:
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
                r = await http.post(
                    "/v1/chat/completions", json=LONG_CHAT, headers={"x-request-id": client_id}
                )
    assert len(client_id) == 128 and r.headers["x-request-id"] == client_id
