"""Request ids: honoured, generated when missing, returned, used as the engine request id, and logged."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest

from harmony_gateway.observability.logging import JsonFormatter
from harmony_gateway.sim import SimConfig
from tests.e2e._fleet import chat, sims
from tests.support.servers import running_gateway
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
                assert engine.requests[-1].request_id == "client-chosen-id"
                body = {"model": "openai/gpt-oss-20b", "messages": [{"role": "user", "content": SECRET}]}
                r = await http.post("/v1/chat/completions", json={**body, "stream": True})
                generated = r.headers["x-request-id"]
                assert len(generated) >= 16 and engine.requests[-1].request_id == generated
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
