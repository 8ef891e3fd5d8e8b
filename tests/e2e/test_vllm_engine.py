"""The gateway in front of vLLM-protocol engines: `--engine vllm`, auto-detection, and PD."""

from __future__ import annotations

import httpx
import openai
import pytest

from harmony_gateway.sim import SimConfig
from tests.conftest import MODEL
from tests.e2e._fleet import answer_text, chat, next_request_id, sims
from tests.support.servers import client_request_id, running_gateway
from tests.support.servers import test_settings as gateway_settings


@pytest.mark.parametrize("engine", ["vllm", "auto"])
async def test_chat_through_vllm_workers(engine: str) -> None:
    configs = (SimConfig(engine="vllm", tokens_per_chunk=2), SimConfig(engine="vllm", strip_stop_token=True))
    async with sims(*configs) as engines:
        settings = gateway_settings(
            worker_urls=tuple(e.url for e in engines), engine=engine, health_interval=0.2
        )
        async with (
            running_gateway(settings) as gw,
            openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0) as client,
        ):
            assert {w.engine for w in gw.state.fleet.all_workers()} == {"vllm"}
            for _ in range(2):  # one request per worker (round robin)
                r = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}]
                )
                assert "simulated answer" in r.choices[0].message.content
                assert r.choices[0].finish_reason == "stop"
                assert r.usage.completion_tokens > 10
                text, usage = "", None
                stream = await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "What is 2+2?"}],
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].delta.content or ""
                    usage = chunk.usage or usage
                assert text == r.choices[0].message.content  # each token once, none repeated
                assert usage is not None and usage.completion_tokens == r.usage.completion_tokens
            assert all(len(e.requests) == 2 for e in engines)


async def test_vllm_pd_passes_kv_transfer_params() -> None:
    async with sims(SimConfig(engine="vllm", mode="prefill"), SimConfig(engine="vllm", mode="decode")) as (
        p,
        d,
    ):
        settings = gateway_settings(
            prefill_urls=(p.url,), decode_urls=(d.url,), engine="vllm", health_interval=0.2
        )
        async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            rid = next_request_id("vpd")
            r = await chat(http, request_id=rid, stream=True)
            assert r.status_code == 200 and "simulated answer" in answer_text(r)
    (prefill_req,) = p.requests
    (decode_req,) = d.requests
    assert prefill_req.request_id == decode_req.request_id and client_request_id(decode_req.request_id) == rid
    assert prefill_req.kv_transfer_params["do_remote_decode"] is True
    assert decode_req.kv_transfer_params["do_remote_prefill"] is True
    assert prefill_req.kv_transfer_params["bootstrap_room"] == decode_req.kv_transfer_params["bootstrap_room"]
