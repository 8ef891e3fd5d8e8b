"""What the largest allowed request costs the event loop, route by route: `/health` keeps answering
(p95 under 50 ms, and no stall over 250 ms) while a body just under `--max-body-bytes` is decoded, validated, rendered, tokenized,
counted or stored. CPU work runs in worker threads in pieces that hand the GIL back often (long texts
are encoded in pieces, prompts are described in a thread), so a thread's work never holds the loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.loop_stall import health_while
from tests.support.servers import RunningGateway, running_gateway, test_settings

BODY_CAP = 8 * 1024 * 1024
SENTENCE = "All work and no play makes Jack a dull boy. "
#: Text that, wrapped in any route's body below, stays under the body cap.
TEXT = SENTENCE * ((BODY_CAP - 4096) // len(SENTENCE))
CONTEXT_PROMPT = SENTENCE * (120_000 // 11)  # about 120k tokens: the longest prompt that is served


def _bodies() -> dict[str, tuple[str, dict[str, Any], set[int]]]:
    """name → (path, body, the statuses the route may answer)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": TEXT}]}
    responses = {"model": MODEL, "input": TEXT}
    messages = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": TEXT}]}
    item = {"type": "message", "role": "user", "content": TEXT[: len(TEXT) // 20 - 200]}
    too_long = {400}  # rendered and tokenized in full, then refused for the model's context
    return {
        "chat": ("/v1/chat/completions", chat, too_long),
        "responses": ("/v1/responses", responses, too_long),
        "messages": ("/v1/messages", messages, too_long),
        "count_tokens": ("/v1/messages/count_tokens", messages, too_long | {200}),
        "render chat": ("/v1/harmony/render", {"api": "chat", "request": chat}, too_long),
        "render responses": ("/v1/harmony/render", {"api": "responses", "request": responses}, too_long),
        "render messages": ("/v1/harmony/render", {"api": "messages", "request": messages}, too_long),
        "render a full context": (
            "/v1/harmony/render",
            {
                "api": "chat",
                "request": {"model": MODEL, "messages": [{"role": "user", "content": CONTEXT_PROMPT}]},
            },
            {200},
        ),
        "completions": ("/v1/completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 4}, too_long),
        "generate": ("/generate", {"text": TEXT, "sampling_params": {"max_new_tokens": 4}}, too_long),
        "conversation": ("/v1/conversations", {"items": [item] * 20}, {200}),
    }


@pytest.fixture(scope="module")
async def gateway_for_stalls(sim: RunningSim) -> AsyncIterator[RunningGateway]:
    async with running_gateway(test_settings(worker_urls=(sim.url,))) as gw:
        yield gw


@pytest.mark.parametrize("name", list(_bodies()))
async def test_the_largest_allowed_request_leaves_the_loop_free(
    gateway_for_stalls: RunningGateway, name: str
) -> None:
    path, body, statuses = _bodies()[name]
    content = orjson.dumps(body)
    assert len(content) < BODY_CAP
    async with httpx.AsyncClient(base_url=gateway_for_stalls.url, timeout=120) as http:
        post = http.post(path, content=content, headers={"content-type": "application/json"})
        stall = await health_while(http, post)
    assert stall.response.status_code in statuses, stall.response.text[:300]
    # Every piece of CPU work runs in a thread and hands the GIL back within milliseconds, but a few are
    # one C call that holds it throughout: orjson decoding the 8 MiB body (~50 ms here), a collection.
    # The polls they delay are a few percent of a request that lasts half a second; the rest answer at
    # once, and nothing holds the loop for long (a blocked loop costs seconds).
    p95 = stall.percentile(0.95)
    assert p95 < 0.05, (p95, stall.latencies[-5:], len(stall.latencies), stall.took)
    assert stall.longest_stall < 0.25, (stall.longest_stall, stall.took)


async def test_parsing_a_long_text_costs_linear_time(gateway_for_stalls: RunningGateway) -> None:
    """Text with Harmony markers is encoded before it is parsed: by the fast encoder, never by
    openai-harmony's own BPE, which is quadratic in a piece's length (100,000 CJK characters in one
    piece would hold a worker thread for most of a minute; here they take milliseconds)."""
    text = "<|start|>assistant<|channel|>final<|message|>" + "中" * 100_000 + "<|return|>"
    async with httpx.AsyncClient(base_url=gateway_for_stalls.url, timeout=20) as http:
        stall = await health_while(http, http.post("/v1/harmony/parse", json={"text": text}))
    assert stall.response.status_code == 200, stall.response.text[:300]
    [message] = stall.response.json()["messages"]
    assert message["channel"] == "final"
    assert stall.took < 10, stall.took
    assert stall.longest_stall < 0.25, (stall.longest_stall, stall.took)
