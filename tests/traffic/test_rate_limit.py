"""Per-key and per-address budgets end to end: headers on success and on 429, keys apart, tokens,
a budget shared by two gateway processes through Redis, Redis gone mid-test, the SDK's own retry."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from unittest.mock import ANY

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.support.processes import start_gateway_process
from tests.traffic._support import (  # noqa: F401  (require_redis: a fixture)
    REDIS_DB,
    REDIS_HOST,
    REDIS_PORT,
    REDIS_URL,
    chat_body,
    redis_keys,
    require_redis,
    sim_and_gateway,
)


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _assert_limited(r: httpx.Response) -> None:
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"


async def test_request_limit_per_key_with_headers() -> None:
    async with sim_and_gateway(rate_limit=2, api_keys=frozenset({"key-a", "key-b"})) as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            body = chat_body(stream=False)
            first = await http.post("/v1/chat/completions", json=body, headers=_auth("key-a"))
            second = await http.post("/v1/chat/completions", json=body, headers=_auth("key-a"))
            third = await http.post("/v1/chat/completions", json=body, headers=_auth("key-a"))
            other = await http.post("/v1/chat/completions", json=body, headers=_auth("key-b"))
            models = await http.get("/v1/models", headers=_auth("key-b"))
        assert first.status_code == second.status_code == 200
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert second.headers["x-ratelimit-remaining-requests"] == "0"
        assert second.headers["x-ratelimit-reset-requests"].endswith("s")
        _assert_limited(third)
        assert third.headers["x-ratelimit-remaining-requests"] == "0"
        assert other.status_code == 200 and other.headers["x-ratelimit-remaining-requests"] == "1"
        # Reads carry the headers and spend a tenth of a request: less than one whole request is left.
        assert models.status_code == 200 and models.headers["x-ratelimit-remaining-requests"] == "0"


async def test_request_limit_per_address_without_keys() -> None:
    async with sim_and_gateway(rate_limit=1) as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            first = await http.post("/v1/chat/completions", json=chat_body(stream=False))
            second = await http.post("/v1/chat/completions", json=chat_body())
            message = await http.post(
                "/v1/messages",
                json={"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
            )
            counted = await http.post(
                "/v1/messages/count_tokens",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
        assert first.status_code == 200
        _assert_limited(second)
        # The Messages API refuses in Anthropic's error shape, its token counting too.
        for refused in (message, counted):
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            assert refused.json() == {"type": "error", "error": {"type": "rate_limit_error", "message": ANY}}


async def test_token_limit_and_a_key_file_limit() -> None:
    from harmony_gateway.traffic.keys import KeyPolicy

    policies = {"small": KeyPolicy(token_rate_limit=20), "big": KeyPolicy()}
    async with sim_and_gateway(
        token_rate_limit=100_000, api_keys=frozenset(policies), key_policies=policies
    ) as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            # Streamed: the completion tokens are counted as they are generated, charged at the end.
            async with http.stream(
                "POST", "/v1/chat/completions", json=chat_body(), headers=_auth("small")
            ) as first:
                assert first.status_code == 200
                assert first.headers["x-ratelimit-limit-tokens"] == "20"
                await first.aread()
            second = await http.post("/v1/chat/completions", json=chat_body(), headers=_auth("small"))
            big = await http.post("/v1/chat/completions", json=chat_body(), headers=_auth("big"))
        _assert_limited(second)
        assert second.headers["x-ratelimit-remaining-tokens"] == "0"
        assert big.status_code == 200 and big.headers["x-ratelimit-limit-tokens"] == "100000"


async def test_prompt_tokens_count_while_the_answer_streams() -> None:
    from harmony_gateway.sim import SimConfig

    # A long answer paced at 20 tokens/s: the stream is still running when the next request comes.
    async with sim_and_gateway(
        SimConfig(port=0, tokens_per_second=20), token_rate_limit=30, api_keys=frozenset({"k"})
    ) as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            async with http.stream(
                "POST", "/v1/chat/completions", json=chat_body("[[long]]"), headers=_auth("k")
            ) as first:
                assert first.status_code == 200
                await anext(first.aiter_bytes())  # the stream has started: its prompt is charged

                async def refused() -> bool:
                    r = await http.post("/v1/chat/completions", json=chat_body(), headers=_auth("k"))
                    return r.status_code == 429

                deadline = asyncio.get_running_loop().time() + 10
                while not await refused():  # the charge is written off the response's send path
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.02)


async def test_sdk_retries_a_429_on_its_own() -> None:
    async with sim_and_gateway(rate_limit=60, api_keys=frozenset({"sdk"})) as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            # Spend the whole minute's budget with cheap bad requests (each still counts).
            spent = await asyncio.gather(
                *(http.post("/v1/chat/completions", json={}, headers=_auth("sdk")) for _ in range(60))
            )
        assert {r.status_code for r in spent} == {400}
        retried: list[int] = []

        async def on_response(response: httpx.Response) -> None:
            retried.append(response.status_code)

        async with httpx.AsyncClient(event_hooks={"response": [on_response]}) as raw:
            client = openai.AsyncOpenAI(
                base_url=gw.url + "/v1", api_key="sdk", max_retries=3, http_client=raw, timeout=30
            )
            r = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        assert r.choices[0].message.content
        assert retried[0] == 429 and retried[-1] == 200


@pytest.mark.usefixtures("require_redis")
async def test_two_gateways_share_one_budget_in_redis() -> None:
    from harmony_gateway.sim import SimConfig, start_sim_engine

    key = f"shared-{uuid.uuid4().hex}"
    async with redis_keys(), await start_sim_engine(SimConfig(port=0)) as sim:
        args = (
            "--worker-url", sim.url, "--storage", "memory://", "--api-key", key,
            "--rate-limit", "3", "--rate-limit-store", REDIS_URL,
        )  # fmt: skip
        one = await start_gateway_process(*args)
        two = await start_gateway_process(*args)
        try:
            statuses = []
            async with httpx.AsyncClient(timeout=30) as http:
                for gateway in (one, two, one, two):
                    r = await http.post(
                        gateway.base_url + "/chat/completions",
                        json=chat_body(stream=False),
                        headers=_auth(key),
                    )
                    statuses.append(r.status_code)
            assert statuses == [200, 200, 200, 429]
        finally:
            one.stop()
            two.stop()
        assert one.proc.returncode == 0 and two.proc.returncode == 0


class _Proxy:
    """A TCP proxy on loopback in front of the shared Redis; stopping it makes Redis unreachable for
    the gateway without touching Redis itself."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(REDIS_HOST, REDIS_PORT)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()


@pytest.mark.usefixtures("require_redis")
async def test_redis_gone_mid_test_keeps_serving() -> None:
    proxy = _Proxy()
    port = await proxy.start()
    async with redis_keys() as client:
        async with sim_and_gateway(
            rate_limit=100, rate_limit_store=f"redis://127.0.0.1:{port}/{REDIS_DB}"
        ) as (_, gw):
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
                before = await http.post("/v1/chat/completions", json=chat_body(stream=False))
                assert before.status_code == 200
                assert before.headers["x-ratelimit-remaining-requests"] == "99"
                assert [k async for k in client.scan_iter("harmony-gateway:rl:*")]
                await proxy.stop()
                after = await http.post("/v1/chat/completions", json=chat_body(stream=False))
                assert after.status_code == 200
                assert after.headers["x-ratelimit-limit-requests"] == "100"
                metrics = (await http.get("/metrics")).text
        assert "gateway_rate_limit_store_up 0.0" in metrics
