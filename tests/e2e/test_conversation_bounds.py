"""Conversations are bounded in what they store and in what a turn loads from them, against a real
gateway on loopback in front of a simulated engine with a small (2,048-token) context.

Reproduces the memory amplification through conversations: megabytes of items written in a few calls,
then one render (or response) naming the conversation loaded and tokenized every item before the
context check. Now a conversation holds at most `--max-conversation-items` items and
`--max-conversation-bytes` bytes (400 `conversation_too_large`), and a turn reads only the newest items
the context could show: 400 `context_length_exceeded` without truncation, the newest that fit with
`truncation: "auto"`.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.servers import RunningGateway, running_gateway, test_settings

CONTEXT = 2048
#: What the small context can show of a conversation at most: 2,048 tokens of 128 bytes each.
BUDGET = CONTEXT * 128


@pytest.fixture(scope="module")
async def small_sim() -> AsyncIterator[RunningSim]:
    engine = await start_sim_engine(SimConfig(port=0, model=MODEL, max_context_length=CONTEXT))
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture(scope="module")
async def gateway(small_sim: RunningSim) -> AsyncIterator[RunningGateway]:
    settings = test_settings(worker_urls=(small_sim.url,), max_conversation_bytes=16 * 1024 * 1024)
    async with running_gateway(settings) as gw:
        yield gw


@pytest.fixture(scope="module")
async def capped(small_sim: RunningSim) -> AsyncIterator[RunningGateway]:
    settings = test_settings(
        worker_urls=(small_sim.url,), max_conversation_items=25, max_conversation_bytes=64 * 1024
    )
    async with running_gateway(settings) as gw:
        yield gw


def message(text: str, role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


def numbers(tag: str, count: int) -> str:
    """Text that tokenizes densely (about two tokens a number), tagged so a prompt shows which it is."""
    return f"[{tag}] " + " ".join(str(1000 + i) for i in range(count))


async def render(gw: RunningGateway, request: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
        return await http.post("/v1/harmony/render", json={"api": "responses", "request": request})


async def filled_conversation(gw: RunningGateway, calls: int) -> str:
    """A conversation of `calls` x 20 items of ~135 kB each (half the context's budget)."""
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
        conversation = await client.conversations.create()
        for call in range(calls):
            items = [message(numbers(f"item {call}-{n}", 24_000)) for n in range(20)]
            await client.conversations.items.create(conversation.id, items=items)  # type: ignore[arg-type]
    return conversation.id


async def peak_memory_of_render(gw: RunningGateway, request: dict[str, Any]) -> tuple[httpx.Response, int]:
    tracemalloc.start()
    try:
        rendered = await render(gw, request)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return rendered, peak


@pytest.mark.parametrize("truncation", ["disabled", "auto"])
async def test_rendering_a_huge_conversation_costs_what_the_context_shows_not_what_is_stored(
    gateway: RunningGateway, truncation: str
) -> None:
    # 2.7 MB and 8.1 MB of items, ten and thirty times what the context could show.
    small, large = await filled_conversation(gateway, 1), await filled_conversation(gateway, 3)
    peaks = []
    for conversation_id in (small, large):
        request = {
            "model": MODEL,
            "input": "and now?",
            "conversation": conversation_id,
            "truncation": truncation,
        }
        rendered, peak = await peak_memory_of_render(gateway, request)
        peaks.append(peak)
        if truncation == "disabled":
            assert rendered.status_code == 400
            error = rendered.json()["error"]
            assert (error["code"], error["param"]) == ("context_length_exceeded", "input")
        else:
            # No item fits the context: none is shown, and the request itself renders.
            assert rendered.status_code == 200, rendered.text
            body = rendered.json()
            assert body["token_count"] < CONTEXT
            assert "[item" not in body["prompt_text"] and "and now?" in body["prompt_text"]
    # Loading and tokenizing every item made the peak grow with the conversation (+648 MB for 76 MB);
    # reading only the newest budget's worth keeps it flat. (The memory store's JSON copy of the one
    # item read reserves ~15x its size, which is most of what is left.)
    assert peaks[1] < 1.5 * peaks[0], peaks
    assert peaks[1] < 20 * BUDGET, peaks


async def test_truncation_auto_keeps_the_newest_items_that_fit(gateway: RunningGateway) -> None:
    tags = [f"turn {n}" for n in range(10)]
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="k", max_retries=0) as client:
        conversation = await client.conversations.create(
            items=[message(numbers(tag, 150), "user" if n % 2 else "assistant") for n, tag in enumerate(tags)]  # type: ignore[misc]
        )
        request = {"model": MODEL, "input": "sum it up", "conversation": conversation.id}

        refused = await render(gateway, request)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"

        rendered = await render(gateway, {**request, "truncation": "auto"})
        assert rendered.status_code == 200, rendered.text
        body = rendered.json()
        shown = [tag for tag in tags if f"[{tag}]" in body["prompt_text"]]
        assert shown and shown == tags[len(tags) - len(shown) :]  # a suffix: the newest ones
        assert len(shown) < len(tags)
        assert body["token_count"] < CONTEXT
        # One more item would not have fitted: the cut is as late as the context allows.
        tokens_per_item = (
            body["token_count"]
            - (await render(gateway, {**request, "conversation": None})).json()["token_count"]
        ) / len(shown)
        assert body["token_count"] + tokens_per_item >= CONTEXT

        # A real response with truncation runs and extends the conversation.
        response = await client.responses.create(
            model=MODEL, input="sum it up", conversation=conversation.id, truncation="auto"
        )
        assert response.status == "completed"
        listed = await client.conversations.items.list(conversation.id, limit=100)
        assert len(listed.data) == len(tags) + 1 + len(response.output)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=MODEL, input="sum it up", conversation=conversation.id)
        assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "input")


async def test_truncation_auto_drops_the_oldest_responses_of_a_chain(gateway: RunningGateway) -> None:
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="k", max_retries=0) as client:
        previous: str | None = None
        for n in range(4):
            kwargs: dict[str, Any] = {"previous_response_id": previous} if previous else {}
            response = await client.responses.create(
                model=MODEL,
                input=numbers(f"step {n}", 200),
                truncation="auto",
                max_output_tokens=64,
                **kwargs,
            )
            previous = response.id
        assert previous is not None
        request = {"model": MODEL, "input": numbers("last", 200), "previous_response_id": previous}
        refused = await render(gateway, request)
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        rendered = await render(gateway, {**request, "truncation": "auto"})
        assert rendered.status_code == 200, rendered.text
        prompt = rendered.json()["prompt_text"]
        assert "[step 3]" in prompt and "[last]" in prompt and "[step 0]" not in prompt


async def chain_of(gw: RunningGateway, length: int) -> str:
    """A chain of `length` responses, each ~300 kB stored but ~1,200 tokens (runs of spaces tokenize
    128 bytes a token): with truncation each fits, and the chain grows past what any prompt shows."""
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
        previous: str | None = None
        for n in range(length):
            kwargs: dict[str, Any] = {"previous_response_id": previous} if previous else {}
            response = await client.responses.create(
                model=MODEL,
                input=f"[link {n}]" + " " * 150_000,
                truncation="auto",
                max_output_tokens=16,
                **kwargs,
            )
            previous = response.id
    assert previous is not None
    return previous


async def test_continuing_a_long_chain_reads_only_what_the_context_could_show(
    gateway: RunningGateway,
) -> None:
    short, long = await chain_of(gateway, 2), await chain_of(gateway, 16)
    peaks = []
    for head in (short, long):
        request = {"model": MODEL, "input": "and now?", "previous_response_id": head}
        refused, _ = await peak_memory_of_render(gateway, request)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        rendered, peak = await peak_memory_of_render(gateway, {**request, "truncation": "auto"})
        assert rendered.status_code == 200, rendered.text
        assert "and now?" in rendered.json()["prompt_text"]
        peaks.append(peak)
    # Every response of the chain was read before: the peak grew with its length.
    assert peaks[1] < 1.5 * peaks[0], peaks


async def test_bad_truncation_is_a_400(gateway: RunningGateway) -> None:
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="k", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=MODEL, input="hi", truncation="sometimes")  # type: ignore[arg-type]
        assert caught.value.param == "truncation"


async def test_conversation_bytes_are_capped(capped: RunningGateway) -> None:
    async with openai.AsyncOpenAI(base_url=capped.base_url, api_key="k", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.conversations.create(items=[message("x" * 70_000)])  # type: ignore[list-item]
        assert (caught.value.code, caught.value.param) == ("conversation_too_large", "items")

        conversation = await client.conversations.create(items=[message("x" * 40_000)])  # type: ignore[list-item]
        with pytest.raises(openai.BadRequestError) as caught:
            await client.conversations.items.create(conversation.id, items=[message("y" * 30_000)])  # type: ignore[list-item]
        assert (caught.value.code, caught.value.param) == ("conversation_too_large", "items")
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=MODEL, input="z" * 30_000, conversation=conversation.id)
        assert (caught.value.code, caught.value.param) == ("conversation_too_large", "conversation")
        listed = await client.conversations.items.list(conversation.id, limit=100)
        assert len(listed.data) == 1  # nothing was added by the refusals


async def test_concurrent_writers_cannot_pass_the_byte_cap_together(capped: RunningGateway) -> None:
    async with openai.AsyncOpenAI(base_url=capped.base_url, api_key="k", max_retries=0) as client:
        conversation = await client.conversations.create()

        async def add() -> bool:
            try:
                await client.conversations.items.create(conversation.id, items=[message("w" * 10_000)])  # type: ignore[list-item]
            except openai.BadRequestError:
                return False
            return True

        accepted = await asyncio.gather(*(add() for _ in range(12)))
        listed = await client.conversations.items.list(conversation.id, limit=100)
        assert sum(accepted) == len(listed.data) == 6  # 6 x ~10 kB fit 64 kB; a seventh would not
