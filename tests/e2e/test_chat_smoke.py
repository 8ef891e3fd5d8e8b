from __future__ import annotations

import openai

from tests.conftest import MODEL


async def test_plain_answer_separates_reasoning(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}]
    )
    message = r.choices[0].message
    assert "simulated answer" in message.content
    assert message.model_extra["reasoning_content"].startswith("The user wrote")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
