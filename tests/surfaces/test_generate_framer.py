"""SGLang's `/generate` framed as data: a plan (`plan_generate`) answered with real Harmony token ids as
engine chunks (tagged with their prompt's index, as a batch delivers them), its `data:` events or body
read back as JSON. The text is the raw Harmony output, special tokens included, cumulative per event."""

from __future__ import annotations

from typing import Any

from harmony_gateway.engines.base import EngineChunk
from harmony_gateway.errors import UpstreamTimeout
from harmony_gateway.harmony.encoding import RETURN
from harmony_gateway.pipeline.context import RequestContext
from harmony_gateway.surfaces.generate.run import plan_generate
from harmony_gateway.surfaces.generate.types import GenerateRequest
from tests.surfaces._support import (
    ANSWER,
    PROMPT_TOKENS,
    RAW_OUTPUT,
    RAW_PROMPT,
    REQUEST_ID,
    engine_chunks,
    harmony_ids,
    of_prompt,
    run_raw,
)

PROMPT, OUTPUT = RAW_PROMPT, RAW_OUTPUT


async def run_generate(
    items: list[tuple[int, EngineChunk]], fail: BaseException | None = None, **body: Any
) -> tuple[Any, RequestContext]:
    return await run_raw("generate", GenerateRequest, plan_generate, "text", items, fail, **body)


async def test_a_stream_sends_the_cumulative_text_and_ids_then_done() -> None:
    chunks = engine_chunks(ANSWER)
    events, ctx = await run_generate(of_prompt(0, chunks), stream=True)
    assert events[-1] == (None, "[DONE]")
    items = [data for _, data in events[:-1]]
    assert len(items) == len(chunks)
    ids = harmony_ids(OUTPUT)
    sent = 0
    for item, chunk in zip(items, chunks, strict=True):
        sent += len(chunk.token_ids)
        assert item["output_ids"] == ids[:sent]
        assert OUTPUT.startswith(item["text"])
        assert "index" not in item  # one prompt, one sample
        assert item["meta_info"]["id"] == REQUEST_ID
        assert item["meta_info"]["prompt_tokens"] == PROMPT_TOKENS
    assert items[-1]["text"] == OUTPUT
    assert [item["meta_info"]["finish_reason"] for item in items] == [None] * (len(items) - 1) + [
        {"type": "stop", "matched": RETURN}
    ]
    assert items[-1]["meta_info"]["completion_tokens"] == len(harmony_ids(ANSWER)) == ctx.completion_tokens


async def test_a_batch_streams_each_prompts_sample_with_its_index() -> None:
    first, second = engine_chunks(ANSWER), engine_chunks(ANSWER)
    interleaved = [
        item for pair in zip(of_prompt(0, first), of_prompt(1, second), strict=True) for item in pair
    ]
    events, ctx = await run_generate(interleaved, stream=True, text=[PROMPT, PROMPT])
    items = [data for _, data in events[:-1]]
    for index in (0, 1):
        mine = [item for item in items if item["index"] == index]
        assert mine[-1]["text"] == OUTPUT
        assert {item["meta_info"]["id"] for item in mine} == {f"{REQUEST_ID}-{index}"}
    assert ctx.completion_tokens == 2 * len(harmony_ids(ANSWER))


async def test_a_failure_mid_stream_ends_with_the_openai_error_then_done() -> None:
    chunks = engine_chunks(ANSWER)
    events, ctx = await run_generate(of_prompt(0, chunks[:1]), UpstreamTimeout("slow engine"), stream=True)
    assert events[-2:] == [
        (None, {"error": UpstreamTimeout("slow engine").to_dict()}),
        (None, "[DONE]"),
    ]
    assert ctx.status == 504


async def test_the_json_body_is_one_item_or_a_list_for_a_batch() -> None:
    body, ctx = await run_generate(of_prompt(0, engine_chunks(ANSWER)))
    assert body["text"] == OUTPUT
    assert body["output_ids"] == harmony_ids(OUTPUT)
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": RETURN}
    assert ctx.prompt_tokens == len(harmony_ids(PROMPT))
    batch, _ = await run_generate(
        of_prompt(1, engine_chunks(ANSWER)) + of_prompt(0, engine_chunks(ANSWER)), text=[PROMPT, PROMPT]
    )
    assert [(item["text"], item["meta_info"]["id"]) for item in batch] == [
        (OUTPUT, f"{REQUEST_ID}-0"),
        (OUTPUT, f"{REQUEST_ID}-1"),
    ]
