"""Malformed gpt-oss output through the real gateway: the simulated engine writes each shape real models
produce (`MALFORMED_TRIGGERS`), and every surface, stream and non-stream, keeps the answer, reports
misplaced text as reasoning, and never hands out control-token text or a 5xx."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from harmony_gateway.sim.script import MALFORMED_TRIGGERS, MISPLACED_TEXT
from tests.conftest import MODEL
from tests.support.servers import RunningGateway

ANSWER_END = "This is a simulated answer."
REFUSAL = "I'm sorry, but I can't help with that."


def expected_answer(trigger: str) -> str | None:
    """The answer text the shape still carries (None: the reply has no answer, only reasoning)."""
    if trigger == "[[bare_refusal]]":
        return REFUSAL
    if trigger == "[[return_after_analysis]]":
        return None
    return f'You said: "Tell me something". {ANSWER_END}'


def check_answer(trigger: str, answer: str | None, reasoning: str) -> None:
    want = expected_answer(trigger)
    assert (answer or None) == want, answer
    assert "<|" not in (answer or "") and "<|" not in reasoning
    assert MISPLACED_TEXT not in (answer or "")
    if trigger in ("[[bad_header]]", "[[unknown_channel]]"):
        assert MISPLACED_TEXT in reasoning  # reported as reasoning, not lost
    assert reasoning


@pytest.mark.parametrize("trigger", MALFORMED_TRIGGERS)
async def test_chat_keeps_the_answer_of_malformed_output(client: openai.AsyncOpenAI, trigger: str) -> None:
    messages: Any = [{"role": "user", "content": f"Tell me something {trigger}"}]
    r = await client.chat.completions.create(model=MODEL, messages=messages)
    message = r.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content") or ""
    check_answer(trigger, message.content, reasoning)
    stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
    content, streamed_reasoning = "", ""
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            streamed_reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
    assert (content or None, streamed_reasoning) == (message.content, reasoning)


@pytest.mark.parametrize("trigger", MALFORMED_TRIGGERS)
async def test_responses_keep_the_answer_of_malformed_output(
    client: openai.AsyncOpenAI, trigger: str
) -> None:
    prompt = f"Tell me something {trigger}"
    r = await client.responses.create(model=MODEL, input=prompt, store=False)
    reasoning = "\n".join(
        part.text for item in r.output if item.type == "reasoning" for part in (item.content or [])
    )
    check_answer(trigger, r.output_text, reasoning)
    stream = await client.responses.create(model=MODEL, input=prompt, store=False, stream=True)
    completed = None
    async for event in stream:
        if event.type == "response.completed":
            completed = event.response
    assert completed is not None
    assert completed.output_text == r.output_text


@pytest.mark.parametrize("trigger", MALFORMED_TRIGGERS)
async def test_anthropic_keeps_the_answer_of_malformed_output(gateway: RunningGateway, trigger: str) -> None:
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="test", max_retries=0, timeout=30) as c:
        request: Any = {
            "model": MODEL,
            "max_tokens": 2048,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": f"Tell me something {trigger}"}],
        }
        r = await c.messages.create(**request)
        text = "".join(b.text for b in r.content if b.type == "text")
        thinking = "".join(b.thinking for b in r.content if b.type == "thinking")
        check_answer(trigger, text, thinking)
        async with c.messages.stream(**request) as stream:
            final = await stream.get_final_message()
        assert "".join(b.text for b in final.content if b.type == "text") == text


async def test_recoveries_are_counted_by_kind(client: openai.AsyncOpenAI, gateway: RunningGateway) -> None:
    for trigger in ("[[bad_header]]", "[[stray_text]]", "[[return_after_analysis]]", "[[bare_refusal]]"):
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me something {trigger}"}]
        )
    async with httpx.AsyncClient() as http:
        text = (await http.get(gateway.url + "/metrics")).text
    lines = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and line[0] != "#"
    }
    assert lines['gateway_harmony_channel_parse_errors_total{kind="unknown_channel"}'] >= 1
    assert lines['gateway_harmony_channel_parse_errors_total{kind="stray_text"}'] >= 1
    assert lines['gateway_harmony_channel_parse_errors_total{kind="no_header"}'] >= 1
    assert lines["gateway_harmony_channel_unexpected_order_total"] >= 1
