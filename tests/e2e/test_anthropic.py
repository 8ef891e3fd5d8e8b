"""The Anthropic Messages API through the official `anthropic` SDK, on the simulated engine."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.servers import RunningGateway, running_gateway, test_settings

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {
        "type": "object",
        "properties": {"location": {"type": "string", "description": "City name"}},
        "required": ["location"],
    },
}
ANSWER = 'You said: "What is 2+2?". This is a simulated answer.'
CLAUDE_CODE_REQUEST = Path(__file__).parent / "data" / "claude_code_request.json"


def _prompt_text(sim: RunningSim) -> str:
    return get_encoding().decode(sim.requests[-1].input_ids)


async def test_plain_message_without_thinking_has_one_text_block(
    anthropic_client: anthropic.AsyncAnthropic, sim: RunningSim
) -> None:
    message = await anthropic_client.messages.create(
        model=MODEL, max_tokens=500, messages=[{"role": "user", "content": "What is 2+2?"}]
    )
    assert message.id.startswith("msg_")
    assert message.model == MODEL
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == ANSWER
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == len(
        sim.requests[-1].input_ids
    )
    assert message.usage.output_tokens > message.usage.output_tokens_details.thinking_tokens > 0
    # Thinking disabled: the lowest effort gpt-oss has.
    assert "Reasoning: low" in _prompt_text(sim)


async def test_thinking_blocks_carry_signatures(
    anthropic_client: anthropic.AsyncAnthropic, sim: RunningSim
) -> None:
    message = await anthropic_client.messages.create(
        model=MODEL,
        max_tokens=2000,
        thinking={"type": "enabled", "budget_tokens": 10000},
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": "What is 2+2?"}],
    )
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking.startswith("The user wrote")
    assert isinstance(thinking.signature, str) and thinking.signature
    assert text.type == "text" and text.text == ANSWER
    prompt = _prompt_text(sim)
    assert "Reasoning: medium" in prompt  # 10000 budget tokens
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in prompt


async def test_adaptive_thinking_takes_effort_from_output_config(
    anthropic_client: anthropic.AsyncAnthropic, sim: RunningSim
) -> None:
    message = await anthropic_client.messages.create(
        model=MODEL,
        max_tokens=2000,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        extra_body={"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}},
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert "Reasoning: high" in _prompt_text(sim)


async def test_stream_rebuilds_the_non_stream_message(anthropic_client: anthropic.AsyncAnthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 2000,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [{"role": "user", "content": "What is 2+2?"}],
    }
    plain = await anthropic_client.messages.create(**kwargs)
    events: list[str] = []
    async with anthropic_client.messages.stream(**kwargs) as stream:
        async for event in stream:
            events.append(event.type if event.type != "content_block_delta" else event.delta.type)
        final = await stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert events[0] == "message_start"
    assert events[-2:] == ["message_delta", "message_stop"]
    # The signature arrives before the thinking block stops; then the text block.
    first_stop = events.index("content_block_stop")
    assert "signature_delta" in events[first_stop - 2 : first_stop]  # the SDK adds a derived event
    assert "thinking_delta" in events[:first_stop] and "text_delta" in events[first_stop:]


async def test_raw_stream_starts_with_message_start_and_ping(gateway: RunningGateway) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(gateway.url + "/v1/messages", json=body, headers={"x-api-key": "test"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["request-id"]
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]
    assert names[-1] == "message_stop"


async def test_tool_use_round_trip(anthropic_client: anthropic.AsyncAnthropic, sim: RunningSim) -> None:
    question = {"role": "user", "content": "Use get_weather for Paris please"}
    first = await anthropic_client.messages.create(
        model=MODEL, max_tokens=1000, tools=[WEATHER], messages=[question]
    )
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_") and call.input == {"location": "Paris"}

    second = await anthropic_client.messages.create(
        model=MODEL,
        max_tokens=1000,
        tools=[WEATHER],
        messages=[
            question,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call.id,
                        "content": [{"type": "text", "text": "Sunny, 21 C"}],
                    }
                ],
            },
        ],
    )
    assert second.stop_reason == "end_turn"
    assert second.content[-1].text == 'The tool functions.get_weather returned: "Sunny, 21 C".'
    prompt = _prompt_text(sim)
    assert (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"location":"Paris"}<|call|>'
        in prompt
    )
    assert (
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>Sunny, 21 C<|end|>"
        in prompt
    )


async def test_streamed_tool_use_has_parsed_input(anthropic_client: anthropic.AsyncAnthropic) -> None:
    async with anthropic_client.messages.stream(
        model=MODEL,
        max_tokens=1000,
        tools=[WEATHER],
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "Use get_weather for Oslo"}],
    ) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"location": "Oslo"}
    assert final.stop_reason == "tool_use"


async def test_tool_choice_none_hides_tools(
    anthropic_client: anthropic.AsyncAnthropic, sim: RunningSim
) -> None:
    message = await anthropic_client.messages.create(
        model=MODEL,
        max_tokens=500,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        messages=[{"role": "user", "content": "Use get_weather for Paris"}],
    )
    assert message.stop_reason == "end_turn"
    assert "get_weather" not in _prompt_text(sim).split("<|start|>user", 1)[0]


async def test_stop_sequence_cuts_the_answer(anthropic_client: anthropic.AsyncAnthropic) -> None:
    message = await anthropic_client.messages.create(
        model=MODEL,
        max_tokens=500,
        stop_sequences=["never", "simulated"],
        messages=[{"role": "user", "content": "What is 2+2?"}],
    )
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == "simulated"
    assert message.content[0].text == 'You said: "What is 2+2?". This is a '


async def test_max_tokens_stop_reason(anthropic_client: anthropic.AsyncAnthropic) -> None:
    message = await anthropic_client.messages.create(
        model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "What is 2+2?"}]
    )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5


async def test_unknown_model_is_not_found(anthropic_client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        await anthropic_client.messages.create(
            model="no-such-model", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.body["error"]["type"] == "not_found_error"
    assert info.value.body["type"] == "error"


async def test_claude_model_names_map_to_the_only_served_model(
    anthropic_client: anthropic.AsyncAnthropic,
) -> None:
    message = await anthropic_client.messages.create(
        model="claude-haiku-4-5-20251001",
        max_tokens=500,
        messages=[{"role": "user", "content": "What is 2+2?"}],
    )
    assert message.model == MODEL and message.content[0].text == ANSWER


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
                ]
            },
            "messages[0].content[0]",
        ),
        ({"thinking": {"type": "enabled"}}, "thinking"),
    ],
)
async def test_bad_requests_are_invalid_request_errors(
    anthropic_client: anthropic.AsyncAnthropic, body: dict[str, Any], param: str
) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
    }
    request.update(body)
    with pytest.raises(anthropic.BadRequestError) as info:
        await anthropic_client.messages.create(**request)
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert param in error["message"]


async def test_mid_stream_engine_failure_is_an_error_event(
    anthropic_client: anthropic.AsyncAnthropic, sim: RunningSim
) -> None:
    sim.fail_next(grpc.StatusCode.INTERNAL, after_tokens=3)
    with pytest.raises(anthropic.APIStatusError) as info:
        async with anthropic_client.messages.stream(
            model=MODEL, max_tokens=500, messages=[{"role": "user", "content": "What is 2+2?"}]
        ) as stream:
            await stream.get_final_message()
    assert info.value.body["error"]["type"] == "api_error"


async def test_engine_unavailable_before_output_is_overloaded(
    anthropic_client: anthropic.AsyncAnthropic, sim: RunningSim
) -> None:
    for _ in range(3):  # the first attempt and every retry fail
        sim.fail_next(grpc.StatusCode.UNAVAILABLE, after_tokens=0)
    try:
        with pytest.raises(anthropic.APIStatusError) as info:
            await anthropic_client.messages.create(
                model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "hi"}]
            )
    finally:
        sim._core._failures.clear()  # leave no armed failure for later tests
    assert info.value.status_code == 529
    assert info.value.body["error"]["type"] == "overloaded_error"


async def test_count_tokens_matches_the_rendered_prompt(
    anthropic_client: anthropic.AsyncAnthropic, sim: RunningSim
) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "system": "Be brief.",
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "What is 2+2?"}],
    }
    counted = await anthropic_client.messages.count_tokens(**kwargs)
    await anthropic_client.messages.create(max_tokens=20, **kwargs)
    assert counted.input_tokens == len(sim.requests[-1].input_ids)


async def test_x_api_key_and_bearer_auth(sim: RunningSim) -> None:
    settings = test_settings(worker_urls=(sim.url,), api_keys=frozenset({"secret"}))
    async with running_gateway(settings) as gw:
        body = {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await bad.messages.create(**body)
            assert info.value.body["error"]["type"] == "authentication_error"
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="secret", max_retries=0) as good:
            assert (await good.messages.create(**body)).content
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(
                gw.url + "/v1/messages", json=body, headers={"authorization": "Bearer secret"}
            )
            assert r.status_code == 200


def _claude_code_request() -> tuple[dict[str, Any], dict[str, str], str]:
    captured = json.loads(CLAUDE_CODE_REQUEST.read_text())
    return captured["body"], captured["headers"], captured["query"]


async def test_replayed_claude_code_request_streams_an_answer(gateway: RunningGateway) -> None:
    """The first request Claude Code 2.1 sends for `claude -p "hello"`: a long system prompt, 25 tools,
    a mid-conversation system message, beta headers, adaptive thinking and output_config."""
    body, headers, query = _claude_code_request()
    assert body["stream"] and len(body["tools"]) > 20
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(
            f"{gateway.url}/v1/messages?{query}", json=body, headers={**headers, "x-api-key": "test"}
        )
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text.endswith("This is a simulated answer.")
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


async def test_replayed_claude_code_request_through_the_sdk(
    anthropic_client: anthropic.AsyncAnthropic, sim: RunningSim
) -> None:
    body, headers, _ = _claude_code_request()
    body = {**body, "stream": False, "model": "claude-sonnet-4-5"}
    message = await anthropic_client.beta.messages.create(
        **{
            k: body[k] for k in ("model", "max_tokens", "messages", "system", "tools", "thinking", "metadata")
        },
        extra_body={k: body[k] for k in ("context_management", "output_config")},
        extra_headers={"anthropic-beta": headers["anthropic-beta"]},
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    prompt = _prompt_text(sim)
    assert "namespace functions {" in prompt and "type Bash = " in prompt
    assert "Reasoning: high" in prompt


async def test_model_alias_setting(sim: RunningSim) -> None:
    settings = test_settings(worker_urls=(sim.url,), model_aliases={"fast": MODEL})
    async with (
        running_gateway(settings) as gw,
        anthropic.AsyncAnthropic(base_url=gw.url, api_key="k") as client,
    ):
        body: dict[str, Any] = {"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
        assert (await client.messages.create(model="fast", **body)).model == MODEL
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="slow", **body)


@pytest.mark.skipif(
    shutil.which("claude") is None, reason="Claude Code is not installed (npm i -g @anthropic-ai/claude-code)"
)
async def test_claude_code_print_mode(gateway: RunningGateway, tmp_path) -> None:
    """Claude Code itself, as a new user runs it: ANTHROPIC_BASE_URL at the gateway, `claude -p`."""
    env = dict(
        os.environ,
        HOME=str(tmp_path),
        ANTHROPIC_BASE_URL=gateway.url,
        ANTHROPIC_API_KEY="test",
        DISABLE_TELEMETRY="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    proc = await asyncio.create_subprocess_exec(
        "claude",
        "-p",
        "hello from the gateway test",
        "--model",
        MODEL,
        cwd=tmp_path,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 90)
    text = out.decode()
    assert proc.returncode == 0, text[-2000:]
    assert "simulated answer" in text
