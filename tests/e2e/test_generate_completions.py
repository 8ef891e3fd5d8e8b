"""`/generate` (SGLang's native API) and `/v1/completions` end to end: raw Harmony prompts and token ids."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from harmony_gateway.harmony.encoding import CALL, RETURN, get_encoding
from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.servers import RunningGateway

PROMPT = "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant"
EXPECTED = (
    "<|channel|>analysis<|message|>The user wrote 3 words. I will answer briefly.<|end|>"
    '<|start|>assistant<|channel|>final<|message|>You said: "What is 2+2?". This is a simulated answer.<|return|>'
)


def _ids(text: str) -> list[int]:
    return list(get_encoding().encode(text, allowed_special="all"))


@pytest.fixture
async def http(gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as c:
        yield c


def _sse(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_generate_text_prompt_returns_raw_harmony(http: httpx.AsyncClient, sim: RunningSim) -> None:
    r = await http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 200}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == EXPECTED
    assert body["output_ids"] == _ids(EXPECTED)
    sent = sim.requests[-1]
    assert sent.input_ids == _ids(PROMPT)  # special-token text became special tokens
    assert {RETURN, CALL} <= set(sent.sampling["stop_token_ids"])
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": RETURN}
    assert meta["prompt_tokens"] == len(sent.input_ids)
    assert meta["completion_tokens"] == len(body["output_ids"])
    assert meta["id"] and "cached_tokens" in meta
    assert "output_token_logprobs" not in meta


async def test_generate_token_ids_pass_through_with_logprobs(
    http: httpx.AsyncClient, sim: RunningSim
) -> None:
    ids = _ids(PROMPT)
    r = await http.post(
        "/generate",
        json={
            "input_ids": ids,
            "return_logprob": True,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 200, "stop_token_ids": [7], "temperature": 0.5},
        },
    )
    body = r.json()
    assert sim.requests[-1].input_ids == ids
    assert sim.requests[-1].sampling["stop_token_ids"][:1] == [7]
    logprobs = body["meta_info"]["output_token_logprobs"]
    assert [entry[1] for entry in logprobs] == body["output_ids"]
    assert all(entry[0] <= 0 and entry[2] is None for entry in logprobs)
    tops = body["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(logprobs) and all(
        len(t) == 2 and t[0][1] == e[1] for t, e in zip(tops, logprobs, strict=True)
    )


async def test_generate_length_and_skip_special_tokens(http: httpx.AsyncClient) -> None:
    r = await http.post(
        "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "skip_special_tokens": True}},
    )
    body = r.json()
    assert len(body["output_ids"]) == 6
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert "<|" not in body["text"] and body["text"].startswith("analysis")


async def test_generate_batch_and_n(http: httpx.AsyncClient) -> None:
    second = "<|start|>user<|message|>Hello<|end|><|start|>assistant"
    r = await http.post(
        "/generate",
        json={"text": [PROMPT, second], "sampling_params": {"max_new_tokens": 200, "n": 2}},
    )
    items = r.json()
    assert len(items) == 4
    assert items[0]["text"] == EXPECTED
    assert items[1]["text"].endswith("This is a simulated answer. (choice 1)<|return|>")
    assert 'You said: "Hello"' in items[2]["text"]
    assert items[0]["meta_info"]["id"] != items[2]["meta_info"]["id"]


async def test_generate_stream_is_cumulative(http: httpx.AsyncClient) -> None:
    r = await http.post(
        "/generate",
        json={
            "input_ids": _ids(PROMPT),
            "stream": True,
            "sampling_params": {"max_new_tokens": 200, "stream_interval": 1},
        },
    )
    events = _sse(r.text)
    assert events[-1] == "[DONE]"
    items = events[:-1]
    assert len(items) > 5
    for earlier, later in zip(items, items[1:], strict=False):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
        assert later["text"].startswith(earlier["text"])
    assert items[-1]["text"] == EXPECTED
    assert items[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert items[0]["meta_info"]["finish_reason"] is None


async def test_generate_rejects_both_inputs(http: httpx.AsyncClient) -> None:
    r = await http.post("/generate", json={"text": "a", "input_ids": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"


async def test_completions_raw_prompt(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    r = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200)
    assert r.object == "text_completion"
    assert r.choices[0].text == EXPECTED
    assert r.choices[0].finish_reason == "stop"
    assert sim.requests[-1].input_ids == _ids(PROMPT)
    assert r.usage.prompt_tokens == len(_ids(PROMPT))
    assert r.usage.completion_tokens == len(_ids(EXPECTED))


async def test_completions_default_max_tokens_is_16(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(model=MODEL, prompt=PROMPT)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16


async def test_completions_token_prompts_echo_logprobs_and_n(client: openai.AsyncOpenAI) -> None:
    ids = _ids(PROMPT)
    r = await client.completions.create(
        model=MODEL, prompt=[ids, ids], n=2, echo=True, logprobs=2, max_tokens=200
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    first = r.choices[0]
    assert first.text == PROMPT + EXPECTED
    lp = first.logprobs
    assert len(lp.tokens) == len(ids) + len(_ids(EXPECTED))
    assert lp.token_logprobs[: len(ids)] == [None] * len(ids)
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[len(ids) :])
    assert "".join(lp.tokens) == first.text
    assert lp.text_offset[len(ids)] == len(PROMPT)
    assert all(len(top) <= 2 for top in lp.top_logprobs[len(ids) :])
    assert r.choices[1].text.endswith("(choice 1)<|return|>")
    assert r.usage.prompt_tokens == 2 * len(ids)


async def test_completions_stream_matches_non_stream(client: openai.AsyncOpenAI) -> None:
    plain = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, logprobs=1)
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=200,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, tokens, finish, usage = "", [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
            finish = choice.finish_reason or finish
    assert text == plain.choices[0].text == EXPECTED
    assert tokens == plain.choices[0].logprobs.tokens
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


async def test_completions_unknown_model(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt="hi")
