"""Token budgets reserve at admission and settle after: a burst of concurrent prompts gets only what
fits, the unused part of a reservation comes back, and a key in debt stays in debt (in Redis too) until
it has refilled."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
import uuid

import httpx
import orjson
import pytest

from harmony_gateway.sim import SimConfig
from harmony_gateway.traffic import rate_limit
from harmony_gateway.traffic.rate_limit import RedisBuckets
from harmony_gateway.traffic.routes import DEFAULT_OUTPUT_RESERVATION, estimate_tokens
from tests.conftest import MODEL
from tests.traffic._support import REDIS_URL, redis_keys, require_redis, sim_and_gateway  # noqa: F401  (a fixture)
from tests.traffic.test_rate_limit import _auth

#: About 3,000 prompt tokens of text: more than the whole of a 3,000-token budget once rendered.
LONG_TEXT = "budget " * 3000


def _chat(text: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def _token_key(api_key: str) -> str:
    return f"harmony-gateway:rl:key:{hashlib.sha256(api_key.encode()).hexdigest()[:24]}:tokens"


def test_estimate_reads_the_output_limit_and_choices() -> None:
    body = b"x" * 400
    assert estimate_tokens(body, {"max_tokens": 50}) == 100 + 50
    assert estimate_tokens(body, {"max_completion_tokens": 20, "max_tokens": 50, "n": 3}) == 100 + 60
    assert estimate_tokens(body, {"sampling_params": {"max_new_tokens": 7, "n": 2}}) == 100 + 14
    assert estimate_tokens(body, None) == 100 + DEFAULT_OUTPUT_RESERVATION
    assert estimate_tokens(body, {"max_tokens": True, "n": -1}) == 100 + DEFAULT_OUTPUT_RESERVATION


async def test_concurrent_large_prompts_get_only_what_fits() -> None:
    """Four prompts each larger than a 3,000 tokens/min budget, sent at once: one runs, three are
    refused with `retry-after` (a positive balance used to let all four through)."""
    async with sim_and_gateway(token_rate_limit=3000, api_keys=frozenset({"k"})) as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
            answers = await asyncio.gather(
                *(
                    http.post(
                        "/v1/chat/completions", json=_chat(LONG_TEXT, max_tokens=16), headers=_auth("k")
                    )
                    for _ in range(4)
                )
            )
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200, 429, 429, 429]
    for refused in (r for r in answers if r.status_code == 429):
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1
    served = next(r for r in answers if r.status_code == 200)
    assert served.json()["usage"]["prompt_tokens"] > 3000


async def test_reservations_hold_while_streams_run_and_come_back_unused() -> None:
    """Two streams reserve their prompt and max_tokens; a third does not fit while they run. When they
    end, the part of their reservations they did not use is given back."""
    body = _chat("Hello there", max_tokens=250, stream=True)
    async with sim_and_gateway(
        SimConfig(port=0, tokens_per_second=20), token_rate_limit=600, api_keys=frozenset({"k"})
    ) as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
            async with (
                http.stream("POST", "/v1/chat/completions", json=body, headers=_auth("k")) as one,
                http.stream("POST", "/v1/chat/completions", json=body, headers=_auth("k")) as two,
            ):
                assert one.status_code == two.status_code == 200
                third = await http.post("/v1/chat/completions", json=body, headers=_auth("k"))
                assert third.status_code == 429
                assert int(third.headers["retry-after"]) >= 1
                await one.aread()
                await two.aread()
            # Settled off the response path: wait until the unused reservations are back.
            deadline = asyncio.get_running_loop().time() + 20
            while True:
                models = await http.get("/v1/models", headers=_auth("k"))
                if int(models.headers["x-ratelimit-remaining-tokens"]) >= 350:
                    break
                assert asyncio.get_running_loop().time() < deadline, models.headers
                await asyncio.sleep(0.05)


@pytest.mark.usefixtures("require_redis")
async def test_redis_key_in_debt_lives_until_it_has_refilled() -> None:
    """A 60 tokens/min key that used ~3,000 tokens owes 50 minutes of refill: its Redis key must live
    that long (it used to expire after 65 s, handing the key a full budget), and it is refused meanwhile."""
    api_key = f"debt-{uuid.uuid4().hex}"
    async with redis_keys() as client:
        async with sim_and_gateway(
            token_rate_limit=60, rate_limit_store=REDIS_URL, api_keys=frozenset({api_key})
        ) as (_, gw):
            async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
                first = await http.post(
                    "/v1/chat/completions", json=_chat(LONG_TEXT, max_tokens=16), headers=_auth(api_key)
                )
                assert first.status_code == 200
                key = _token_key(api_key)
                deadline = asyncio.get_running_loop().time() + 20
                while float(await client.hget(key, "level") or 0) >= 0:  # settled off the path
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.05)
                level = float(await client.hget(key, "level") or 0)
                assert level < -2000
                refill = (60 - level) * 60 / 60
                ttl = await client.ttl(key)
                assert refill - 5 <= ttl <= refill + 10
                second = await http.post(
                    "/v1/chat/completions", json=_chat("hi", max_tokens=1), headers=_auth(api_key)
                )
                assert second.status_code == 429
                assert int(second.headers["retry-after"]) > 65


@pytest.mark.usefixtures("require_redis")
async def test_debt_persists_in_redis_until_refilled_with_a_fast_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a 2-second window a debt of twice the limit refills in 6 s: the key keeps it (refusing)
    until then, and only then expires."""
    monkeypatch.setattr(rate_limit, "WINDOW_SECONDS", 2.0)
    buckets = RedisBuckets(REDIS_URL)
    name = f"fast-{uuid.uuid4().hex}"
    try:
        async with redis_keys() as client:
            assert (await buckets.run(name, 10, "take", 10)).allowed
            in_debt = await buckets.run(name, 10, "charge", 20)  # used 30 against a reservation of 10
            charged_at = time.monotonic()
            assert in_debt.level <= -19
            ttl = await client.ttl(buckets.prefix + name)
            refill = math.ceil((10 - in_debt.level) * 2 / 10)
            assert refill <= ttl <= refill + rate_limit.KEY_TTL_MARGIN_SECONDS
            assert not (await buckets.run(name, 10, "take", 1)).allowed
            # Still in debt while it refills: the key is not forgotten early.
            while (state := await buckets.run(name, 10, "peek")).level < 0:
                assert await client.exists(buckets.prefix + name)
                assert not (await buckets.run(name, 10, "take", 1)).allowed
                await asyncio.sleep(0.2)
            # Out of debt no sooner than the refill takes (10 tokens per 2 s): a key that expired early
            # would have answered a full bucket at once. (A busy machine only makes the loop later.)
            assert time.monotonic() - charged_at >= -in_debt.level * 2 / 10 - 0.5
            assert state.level >= 0
    finally:
        await buckets.close()


async def test_local_bucket_keeps_a_debt_until_refilled(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(rate_limit.time, "monotonic", lambda: now[0])
    buckets = rate_limit.LocalBuckets()
    assert (await buckets.run("k", 60, "take", 60)).allowed
    assert (await buckets.run("k", 60, "charge", 240)).level == -240  # 300 s to refill
    now[0] += 200
    buckets.sweep(now[0])
    assert len(buckets) == 1 and (await buckets.run("k", 60, "peek")).level == pytest.approx(-40)
    assert not (await buckets.run("k", 60, "take", 1)).allowed
    now[0] += 101
    buckets.sweep(now[0])
    assert len(buckets) == 0
    # A settlement gives back at most up to the limit.
    assert (await buckets.run("k", 60, "charge", -500)).level == 60


async def test_a_body_traffic_control_decoded_is_not_decoded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reserving tokens needs the body's output limit, so traffic control decodes it; the route takes
    that decoded body instead of decoding the same (up to 8 MiB) bytes a second time."""
    marker = "decode-me-once " * 30_000
    decoded: list[int] = []
    loads = orjson.loads

    def counting_loads(data: bytes | str) -> object:
        if len(data) > len(marker):
            decoded.append(len(data))
        return loads(data)

    monkeypatch.setattr(orjson, "loads", counting_loads)
    async with sim_and_gateway(token_rate_limit=10_000_000, api_keys=frozenset({"k"})) as (_, gw):
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
            r = await http.post("/v1/chat/completions", json=_chat(marker, max_tokens=4), headers=_auth("k"))
    assert r.status_code == 200, r.text
    assert len(decoded) == 1
