"""Prompts that cache: the system date of a Responses chain or conversation is its first turn's (so the
prefix survives midnight), `prompt_cache_key` routes, and `cached_tokens` is reported on every surface."""

from __future__ import annotations

import datetime as dt
import sqlite3
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim, SimConfig
from tests.conftest import MODEL
from tests.e2e._fleet import next_request_id, served_by, sims
from tests.support.servers import RunningGateway, running_gateway, test_settings

OLD_DATE = "2020-01-01"


def last_prompt(sim: RunningSim) -> str:
    return get_encoding().decode(sim.requests[-1].input_ids)


async def test_chain_and_conversation_keep_their_first_date(sim: RunningSim, tmp_path: Path) -> None:
    db = tmp_path / "gw.db"
    settings = test_settings(
        worker_urls=(sim.url,), conversation_start_date=None, storage_url=f"sqlite:///{db}"
    )
    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    async with running_gateway(settings) as gw:
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as c:
            first = await c.responses.create(model=MODEL, input="first turn")
            assert f"Current date: {today}" in last_prompt(sim)
            conversation = await c.conversations.create()
            with sqlite3.connect(db) as conn:  # as if both had started on an earlier day
                conn.execute(
                    "UPDATE responses SET metadata = json_set(metadata, '$._date', ?) WHERE id = ?",
                    (OLD_DATE, first.id),
                )
                old = int(dt.datetime(2020, 1, 1, 12, tzinfo=dt.UTC).timestamp())
                conn.execute("UPDATE conversations SET created_at = ? WHERE id = ?", (old, conversation.id))
            second = await c.responses.create(model=MODEL, input="second turn", previous_response_id=first.id)
            assert f"Current date: {OLD_DATE}" in last_prompt(sim)
            await c.responses.create(model=MODEL, input="third turn", previous_response_id=second.id)
            assert f"Current date: {OLD_DATE}" in last_prompt(sim)  # inherited along the chain
            await c.responses.create(model=MODEL, input="in a conversation", conversation=conversation.id)
            assert f"Current date: {OLD_DATE}" in last_prompt(sim)
            await c.responses.create(model=MODEL, input="a new chain")
            assert f"Current date: {today}" in last_prompt(sim)


async def test_cached_tokens_on_every_surface(gateway: RunningGateway, client: openai.AsyncOpenAI) -> None:
    long_text = "Please consider this shared context sentence. " * 40
    messages: Any = [{"role": "user", "content": long_text + "first"}]
    await client.chat.completions.create(model=MODEL, messages=messages)
    chat = await client.chat.completions.create(model=MODEL, messages=messages)
    assert chat.usage and chat.usage.prompt_tokens_details
    assert chat.usage.prompt_tokens_details.cached_tokens
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage async for c in stream if c.usage]
    assert usage[-1].prompt_tokens_details and usage[-1].prompt_tokens_details.cached_tokens
    await client.responses.create(model=MODEL, input=long_text + "second", prompt_cache_key="k1")
    r = await client.responses.create(model=MODEL, input=long_text + "second", prompt_cache_key="k1")
    assert r.usage and r.usage.input_tokens_details.cached_tokens
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="k", max_retries=0) as a:
        body: Any = {"model": MODEL, "max_tokens": 256, "messages": [{"role": "user", "content": long_text}]}
        await a.messages.create(**body)
        m = await a.messages.create(**body)
        assert m.usage.cache_read_input_tokens


async def test_prompt_cache_key_routes_cache_aware_and_consistent_hash() -> None:
    """Turns of one `prompt_cache_key` stay on one engine even when their prompts share little."""
    for policy in ("cache_aware", "consistent_hash"):
        async with sims(SimConfig(), SimConfig(), SimConfig()) as engines:
            settings = test_settings(
                worker_urls=tuple(e.url for e in engines), policy=policy, health_interval=0.2
            )
            async with (
                running_gateway(settings) as gw,
                httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
            ):
                homes: dict[str, set[int]] = {}
                for turn in range(4):
                    for key in ("session-a", "session-b", "session-c", "session-d"):
                        rid = next_request_id("pck")
                        body = {"model": MODEL, "input": f"{key} turn {turn} {rid}", "prompt_cache_key": key}
                        r = await http.post("/v1/responses", json=body, headers={"x-request-id": rid})
                        assert r.status_code == 200, r.text
                        homes.setdefault(key, set()).update(served_by(rid, engines))
        assert all(len(home) == 1 for home in homes.values()), (policy, homes)
