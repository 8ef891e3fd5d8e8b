"""The reasoning budget cuts a long analysis, aborts that generation and still yields a final answer."""

from __future__ import annotations

import anthropic
import openai
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.pipeline.reasoning_budget import AnalysisMeter, answer_opener
from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.servers import RunningGateway

LONG = "Explain the plan [[long]]"
BUDGET = 40


def _ids(text: str) -> list[int]:
    return list(get_encoding().encode(text, allowed_special="all"))


def test_meter_counts_analysis_content_only() -> None:
    meter = AnalysisMeter(get_encoding().decode)
    out = _ids("<|channel|>analysis<|message|>one two three<|end|>")
    out += _ids("<|start|>assistant to=functions.f<|channel|>analysis <|constrain|>json<|message|>{}<|call|>")
    assert meter.cut_point(out, 100) is None
    assert meter.count == len(_ids("one two three"))
    more = _ids("<|start|>assistant<|channel|>final<|message|>answer text<|return|>")
    assert meter.cut_point(more, 100) is None
    assert meter.count == len(_ids("one two three"))
    again = _ids("<|start|>assistant<|channel|>analysis<|message|>four five six seven")
    cut = meter.cut_point(again, meter.count + 2)
    assert cut == len(_ids("<|start|>assistant<|channel|>analysis<|message|>")) + 2


def _requests_since(sim: RunningSim, start: int) -> list[object]:
    return list(sim.requests[start:])


async def test_chat_non_stream_budget_cuts_analysis_and_answers(
    client: openai.AsyncOpenAI, sim: RunningSim, gateway: RunningGateway
) -> None:
    start = len(sim.requests)
    r = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG}],
        extra_body={"max_reasoning_tokens": BUDGET},
    )
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert len(get_encoding().encode(reasoning, allowed_special=set())) <= BUDGET + 1
    assert message.content == 'You said: "Explain the plan". This is a simulated answer.'
    assert r.choices[0].finish_reason == "stop"
    details = r.usage.completion_tokens_details
    assert details.model_extra["reasoning_budget_exceeded"] is True
    answer_tokens = len(get_encoding().encode(message.content, allowed_special=set())) + 1
    # Both generations are counted: the kept analysis (header included) and the continuation.
    assert r.usage.completion_tokens >= BUDGET + answer_tokens
    first, second = _requests_since(sim, start)
    assert first.request_id in sim.aborted
    assert second.request_id == first.request_id + "-answer0"
    opener = answer_opener(gateway.state)
    assert second.input_ids[: len(first.input_ids)] == first.input_ids
    assert second.input_ids[-len(opener) :] == opener
    # The continuation's token budget is what the first generation left.
    assert second.sampling.get("n") == 1


async def test_chat_stream_budget_matches_non_stream(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG}],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"max_reasoning_tokens": BUDGET},
    )
    content, reasoning, finish, usage = "", "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            finish = choice.finish_reason or finish
    assert content == 'You said: "Explain the plan". This is a simulated answer.'
    assert reasoning.startswith("The user wrote 3 words.")
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens_details.model_extra["reasoning_budget_exceeded"]


async def test_chat_budget_not_reached_leaves_one_generation(
    client: openai.AsyncOpenAI, sim: RunningSim
) -> None:
    start = len(sim.requests)
    r = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Short question"}],
        extra_body={"max_reasoning_tokens": 500},
    )
    assert len(_requests_since(sim, start)) == 1
    assert r.usage.completion_tokens_details.model_extra["reasoning_budget_exceeded"] is False
    assert "simulated answer" in r.choices[0].message.content


async def test_chat_budget_with_two_choices_continues_each(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG}],
        n=2,
        extra_body={"max_reasoning_tokens": BUDGET},
    )
    # Each cut choice is continued by its own n=1 request, so both get the (choice 0) answer text.
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [
        'You said: "Explain the plan". This is a simulated answer.'
    ] * 2
    assert all(c.message.model_extra["reasoning_content"] for c in r.choices)


async def test_chat_budget_must_be_positive(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"max_reasoning_tokens": 0}
        )
    assert info.value.param == "max_reasoning_tokens"


async def test_anthropic_thinking_budget_cuts_analysis(
    anthropic_client: anthropic.AsyncAnthropic, sim: RunningSim
) -> None:
    start = len(sim.requests)
    message = await anthropic_client.messages.create(
        model=MODEL,
        max_tokens=2000,
        thinking={"type": "enabled", "budget_tokens": BUDGET},
        messages=[{"role": "user", "content": LONG}],
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert len(get_encoding().encode(message.content[0].thinking, allowed_special=set())) <= BUDGET + 1
    assert message.content[1].text == 'You said: "Explain the plan". This is a simulated answer.'
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens_details.model_extra["reasoning_budget_exceeded"] is True
    assert len(_requests_since(sim, start)) == 2


async def test_anthropic_stream_thinking_budget(anthropic_client: anthropic.AsyncAnthropic) -> None:
    async with anthropic_client.messages.stream(
        model=MODEL,
        max_tokens=2000,
        thinking={"type": "enabled", "budget_tokens": BUDGET},
        messages=[{"role": "user", "content": LONG}],
    ) as stream:
        message = await stream.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].signature
    assert message.content[1].text == 'You said: "Explain the plan". This is a simulated answer.'
    assert message.usage.output_tokens > BUDGET


async def test_budget_hits_are_counted_in_metrics(
    client: openai.AsyncOpenAI, gateway: RunningGateway
) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def hits(text: str) -> float:
        for family in text_string_to_metric_families(text):
            if family.name == "gateway_harmony_reasoning_budget_exceeded":
                return sum(s.value for s in family.samples if s.labels.get("route") == "chat")
        return 0.0

    async with httpx.AsyncClient(base_url=gateway.url) as http:
        before = hits((await http.get("/metrics")).text)
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": LONG}],
            extra_body={"max_reasoning_tokens": BUDGET},
        )
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "short"}])
        after = hits((await http.get("/metrics")).text)
    assert after == before + 1
