"""Who may see what, shared PostgreSQL between replicas, and durability across SIGKILL."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator

import asyncpg
import openai
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from tests.conftest import MODEL
from tests.support.processes import start_gateway_process
from tests.support.servers import running_gateway, test_settings

PG_URL = os.environ.get("GATEWAY_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture
async def pg_schema() -> AsyncIterator[str]:
    schema = f"hg_e2e_{uuid.uuid4().hex[:10]}"
    try:
        conn = await asyncpg.connect(PG_URL.replace("postgresql+asyncpg://", "postgresql://"), timeout=5)
    except (OSError, asyncpg.PostgresError) as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"PostgreSQL not reachable: {exc}")
    try:
        yield schema
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


def _client(base_url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)


async def test_api_keys_isolate_owners(sim) -> None:
    settings = test_settings(worker_urls=(sim.url,), api_keys=frozenset({"key-a", "key-b"}))
    async with running_gateway(settings) as gw:
        async with _client(gw.base_url, "wrong") as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.responses.create(model=MODEL, input="hi")
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        async with _client(gw.base_url, "key-a") as a, _client(gw.base_url, "key-b") as b:
            mine = await a.responses.create(model=MODEL, input="private question")
            conv = await a.conversations.create(items=[{"role": "user", "content": "secret"}])
            assert (await a.responses.retrieve(mine.id)).id == mine.id
            with pytest.raises(openai.NotFoundError):
                await b.responses.retrieve(mine.id)
            with pytest.raises(openai.NotFoundError):
                await b.responses.input_items.list(mine.id)
            with pytest.raises(openai.BadRequestError) as info:
                await b.responses.create(model=MODEL, input="continue", previous_response_id=mine.id)
            assert info.value.code == "previous_response_not_found"
            with pytest.raises(openai.NotFoundError):
                await b.responses.delete(mine.id)
            with pytest.raises(openai.NotFoundError):
                await b.conversations.retrieve(conv.id)
            with pytest.raises(openai.NotFoundError):
                await b.conversations.items.list(conv.id)
            with pytest.raises(openai.NotFoundError):
                await b.responses.create(model=MODEL, input="join", conversation=conv.id)
            with pytest.raises(openai.NotFoundError):
                await b.conversations.delete(conv.id)
            # A still has everything.
            assert (await a.responses.retrieve(mine.id)).status == "completed"
            assert len((await a.conversations.items.list(conv.id)).data) == 1


async def test_two_gateway_processes_share_postgres(sim, pg_schema: str) -> None:
    storage = ["--storage", PG_URL, "--storage-schema", pg_schema, "--worker-url", sim.url]
    first = await start_gateway_process(*storage)
    second = await start_gateway_process(*storage)
    try:
        async with _client(first.base_url) as c1, _client(second.base_url) as c2:
            r1 = await c1.responses.create(model=MODEL, input="remember the word zebra")
            read = await c2.responses.retrieve(r1.id)
            assert read.output_text == r1.output_text
            r2 = await c2.responses.create(model=MODEL, input="which word?", previous_response_id=r1.id)
            assert r2.previous_response_id == r1.id
            prompt = get_encoding().decode(sim.requests[-1].input_ids)
            assert "remember the word zebra" in prompt and "which word?" in prompt
    finally:
        first.stop()
        second.stop()


async def test_sigkill_loses_nothing_sqlite(sim, tmp_path) -> None:
    await _kill_and_reread(sim, ["--storage", f"sqlite:///{tmp_path / 'responses.db'}"])


async def test_sigkill_loses_nothing_postgres(sim, pg_schema: str) -> None:
    await _kill_and_reread(sim, ["--storage", PG_URL, "--storage-schema", pg_schema])


async def _kill_and_reread(sim, storage: list[str]) -> None:
    """SIGKILL right after two responses were reported completed; a new process still has both."""
    gateway = await start_gateway_process(*storage, "--worker-url", sim.url)
    try:
        async with _client(gateway.base_url) as c:
            done = await c.responses.create(model=MODEL, input="durable answer please")
            async with c.responses.stream(model=MODEL, input="durable stream please") as stream:
                async for _ in stream:
                    pass
                final = await stream.get_final_response()
        gateway.kill()
        restarted = await start_gateway_process(*storage, "--worker-url", sim.url)
        try:
            async with _client(restarted.base_url) as c:
                assert (await c.responses.retrieve(done.id)).output_text == done.output_text
                assert (await c.responses.retrieve(final.id)).status == "completed"
        finally:
            restarted.stop()
    finally:
        gateway.kill()


async def test_restart_marks_interrupted_background_responses_failed(tmp_path) -> None:
    from harmony_gateway.sim import SimConfig, start_sim_engine

    storage = ["--storage", f"sqlite:///{tmp_path / 'responses.db'}"]
    async with await start_sim_engine(SimConfig(tokens_per_second=20)) as slow:
        gateway = await start_gateway_process(*storage, "--worker-url", slow.url)
        try:
            async with _client(gateway.base_url) as c:
                running = await c.responses.create(
                    model=MODEL, input="[[long]] take your time", background=True
                )
                for _ in range(100):
                    if (await c.responses.retrieve(running.id)).status == "in_progress":
                        break
                    await asyncio.sleep(0.05)
            gateway.kill()
            restarted = await start_gateway_process(*storage, "--worker-url", slow.url, port=gateway.port)
            try:
                async with _client(restarted.base_url) as c:
                    after = await c.responses.retrieve(running.id)
                    assert after.status == "failed"
                    assert "restarted" in after.error.message
            finally:
                restarted.stop()
        finally:
            gateway.kill()
