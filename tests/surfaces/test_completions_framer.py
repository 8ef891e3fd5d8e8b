"""Legacy `/v1/completions` framed as data: a plan (`plan_completions`) answered with real Harmony token
ids as engine chunks (tagged with their prompt's index), its `text_completion` chunks or body read back
as JSON. Each chunk carries the new text only; the raw Harmony output keeps its special tokens."""

from __future__ import annotations

from typing import Any

from harmony_gateway.engines.base import EngineChunk
from harmony_gateway.errors import UpstreamTimeout
from harmony_gateway.pipeline.context import RequestContext
from harmony_gateway.surfaces.completions.run import plan_completions
from harmony_gateway.surfaces.completions.types import CompletionRequest
from tests.surfaces._support import (
    ANSWER,
    MODEL,
    PROMPT_TOKENS,
    RAW_OUTPUT,
    RAW_PROMPT,
    REQUEST_ID,
    Event,
    engine_chunks,
    harmony_ids,
    of_prompt,
    run_raw,
)

PROMPT, OUTPUT = RAW_PROMPT, RAW_OUTPUT


async def run_completions(
    items: list[tuple[int, EngineChunk]], fail: BaseException | None = None, **body: Any
) -> tuple[Any, RequestContext]:
    return await run_raw("completions", CompletionRequest, plan_completions, "prompt", items, fail, **body)


def choices(events: list[Event]) -> list[tuple[int, str, str | None]]:
    """(index, text, finish_reason) of every chunk, after checking each is a chunk of this completion."""
    out = []
    for name, chunk in events:
        assert name is None
        assert (chunk["id"], chunk["object"], chunk["model"]) == (
            f"cmpl-{REQUEST_ID}",
            "text_completion",
            MODEL,
        )
        for choice in chunk["choices"]:
            out.append((choice["index"], choice["text"], choice["finish_reason"]))
    return out


async def test_a_stream_sends_each_new_text_then_the_finish_then_done() -> None:
    chunks = engine_chunks(ANSWER)
    events, ctx = await run_completions(of_prompt(0, chunks), stream=True)
    assert events[-1] == (None, "[DONE]")
    sent = choices(events[:-1])
    texts = [text for _, text, finish in sent if finish is None]
    assert len(texts) == len(chunks) and all(texts)
    assert "".join(texts) == OUTPUT
    assert sent[-1] == (0, "", "stop")
    assert all("usage" not in chunk for _, chunk in events[:-1])  # only when include_usage asks
    assert ctx.completion_tokens == len(harmony_ids(ANSWER))


async def test_echo_sends_the_prompt_first() -> None:
    events, _ = await run_completions(of_prompt(0, engine_chunks(ANSWER)), stream=True, echo=True)
    sent = choices(events[:-1])
    assert sent[0] == (0, PROMPT, None)
    assert "".join(text for _, text, _ in sent[1:]) == OUTPUT


async def test_usage_is_the_last_chunk_when_asked_for() -> None:
    events, _ = await run_completions(
        of_prompt(0, engine_chunks(ANSWER)), stream=True, stream_options={"include_usage": True}
    )
    assert all(chunk["usage"] is None for _, chunk in events[:-2])
    usage_chunk = events[-2][1]
    assert usage_chunk["choices"] == []
    completion = len(harmony_ids(ANSWER))
    assert usage_chunk["usage"] == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion,
        "total_tokens": PROMPT_TOKENS + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_choices_are_numbered_prompt_major() -> None:
    """Choice index = prompt index × n + sample."""
    items = of_prompt(1, engine_chunks(ANSWER, index=1)) + of_prompt(0, engine_chunks(ANSWER, index=0))
    events, _ = await run_completions(items, stream=True, prompt=[PROMPT, PROMPT], n=2)
    finished = [index for index, _, finish in choices(events[:-1]) if finish]
    assert finished == [3, 0]


async def test_a_failure_mid_stream_ends_with_the_openai_error_then_done() -> None:
    chunks = engine_chunks(ANSWER)
    events, ctx = await run_completions(of_prompt(0, chunks[:1]), UpstreamTimeout("slow engine"), stream=True)
    assert events[-2:] == [
        (None, {"error": UpstreamTimeout("slow engine").to_dict()}),
        (None, "[DONE]"),
    ]
    assert ctx.status == 504


async def test_the_json_body() -> None:
    body, ctx = await run_completions(of_prompt(0, engine_chunks(ANSWER)), echo=True)
    assert (body["id"], body["object"], body["model"]) == (f"cmpl-{REQUEST_ID}", "text_completion", MODEL)
    assert body["choices"] == [
        {"index": 0, "text": PROMPT + OUTPUT, "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"]["completion_tokens"] == len(harmony_ids(ANSWER)) == ctx.completion_tokens
