"""The gateway in front of a real engine server it did not write: smg-grpc-servicer's MLX servicer on the
CPU, serving the tiny Harmony-trained gpt-oss (`harmony_gateway.sim.tiny_model`; docs/tiny-model.md),
driven with the official openai SDK. Greedy decoding (temperature 0) makes every answer exact.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import openai
import pytest
from smg_grpc_proto.generated import mlx_engine_pb2 as pb

from harmony_gateway.sim import tiny_model as tm
from tests.real_engines.conftest import real_settings
from tests.support.real_engines import RecordingProxy, start_mlx_servicer
from tests.support.servers import RunningGateway, running_gateway

CHAT_TOOL = {"type": "function", "function": tm.WEATHER_TOOL}
RESPONSES_TOOL = {"type": "function", **tm.WEATHER_TOOL}
GENERATE = "/mlx.grpc.engine.MlxEngine/Generate"
ABORT = "/mlx.grpc.engine.MlxEngine/Abort"


def model_name(tiny_model: Path) -> str:
    return str(tiny_model)  # the MLX servicer serves the model under its path


def generate_calls(proxy: RecordingProxy) -> list[tuple[pb.GenerateRequest, list[pb.GenerateResponse]]]:
    out = []
    for call in proxy.calls:
        if call.method == GENERATE:
            replies = [pb.GenerateResponse.FromString(r) for r in call.responses]
            out.append((pb.GenerateRequest.FromString(call.request), replies))
    return out


async def test_chat_answers_exactly_stream_and_not(mlx_client: openai.AsyncOpenAI, tiny_model: Path) -> None:
    messages = [{"role": "user", "content": tm.HELLO_PROMPT}]
    whole = await mlx_client.chat.completions.create(
        model=model_name(tiny_model),
        messages=messages,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = whole.choices[0]
    assert choice.message.content == tm.HELLO_ANSWER
    assert choice.message.reasoning_content == tm.HELLO_REASONING  # type: ignore[attr-defined]
    assert choice.finish_reason == "stop"
    assert whole.usage is not None and whole.usage.completion_tokens > 5

    content, reasoning, finish, usage = "", "", None, None
    stream = await mlx_client.chat.completions.create(
        model=model_name(tiny_model),
        messages=messages,  # type: ignore[arg-type]
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            finish = chunk.choices[0].finish_reason or finish
    assert (content, reasoning, finish) == (tm.HELLO_ANSWER, tm.HELLO_REASONING, "stop")
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


async def test_what_the_mlx_wire_requires_is_sent(
    mlx_client: openai.AsyncOpenAI, mlx_proxy: RecordingProxy, tiny_model: Path
) -> None:
    await mlx_client.chat.completions.create(
        model=model_name(tiny_model), messages=[{"role": "user", "content": tm.HELLO_PROMPT}], temperature=0
    )
    request, replies = generate_calls(mlx_proxy)[-1]
    sp = request.sampling_params
    assert {200002, 200012} <= set(sp.stop_token_ids)  # only eos_token_id stops otherwise
    assert sp.HasField("temperature") and sp.temperature == 0.0
    assert sp.HasField("max_tokens") and 0 < sp.max_tokens < 8192
    assert replies[-1].WhichOneof("response") == "complete"


async def test_chat_tool_round_trip(mlx_client: openai.AsyncOpenAI, tiny_model: Path) -> None:
    messages: list[dict[str, object]] = [{"role": "user", "content": tm.WEATHER_PROMPT}]
    first = await mlx_client.chat.completions.create(
        model=model_name(tiny_model),
        messages=messages,
        tools=[CHAT_TOOL],
        temperature=0,  # type: ignore[arg-type, list-item]
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": tm.WEATHER_RESULT},
    ]
    second = await mlx_client.chat.completions.create(
        model=model_name(tiny_model),
        messages=messages,
        tools=[CHAT_TOOL],
        temperature=0,  # type: ignore[arg-type, list-item]
    )
    assert second.choices[0].message.content == tm.AFTER_TOOL_ANSWER
    assert second.choices[0].finish_reason == "stop"


async def test_responses_stream_and_not_with_a_tool_round_trip(
    mlx_client: openai.AsyncOpenAI, tiny_model: Path
) -> None:
    model = model_name(tiny_model)
    hello = await mlx_client.responses.create(model=model, input=tm.HELLO_PROMPT, temperature=0, store=False)
    assert hello.status == "completed" and hello.output_text == tm.HELLO_ANSWER
    events: list[str] = []
    text = ""
    stream = await mlx_client.responses.create(
        model=model, input=tm.HELLO_PROMPT, temperature=0, store=False, stream=True
    )
    async for event in stream:
        events.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    assert text == tm.HELLO_ANSWER
    assert events[0] == "response.created" and events[-1] == "response.completed"

    first = await mlx_client.responses.create(
        model=model,
        input=tm.WEATHER_PROMPT,
        tools=[RESPONSES_TOOL],
        temperature=0,
        store=False,  # type: ignore[list-item]
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    follow_up = [
        {"role": "user", "content": tm.WEATHER_PROMPT},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": tm.WEATHER_RESULT},
    ]
    second = await mlx_client.responses.create(
        model=model,
        input=follow_up,
        tools=[RESPONSES_TOOL],
        temperature=0,
        store=False,  # type: ignore[arg-type, list-item]
    )
    assert second.output_text == tm.AFTER_TOOL_ANSWER


async def test_max_tokens_cuts_the_answer(mlx_client: openai.AsyncOpenAI, tiny_model: Path) -> None:
    messages = [{"role": "user", "content": tm.COUNT_PROMPT}]
    full = await mlx_client.chat.completions.create(
        model=model_name(tiny_model),
        messages=messages,
        temperature=0,  # type: ignore[arg-type]
    )
    assert full.choices[0].message.content == tm.COUNT_ANSWER
    assert full.usage is not None
    budget = full.usage.completion_tokens - 10
    cut = await mlx_client.chat.completions.create(
        model=model_name(tiny_model),
        messages=messages,
        temperature=0,
        max_tokens=budget,  # type: ignore[arg-type]
    )
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage is not None and cut.usage.completion_tokens == budget
    content = cut.choices[0].message.content or ""
    assert content and tm.COUNT_ANSWER.startswith(content) and content != tm.COUNT_ANSWER


async def test_a_client_disconnect_is_an_abort_the_engine_sees(
    mlx_client: openai.AsyncOpenAI, mlx_proxy: RecordingProxy, mlx_gateway: RunningGateway, tiny_model: Path
) -> None:
    before = len(mlx_proxy.calls)
    stream = await mlx_client.chat.completions.create(
        model=model_name(tiny_model),
        messages=[{"role": "user", "content": tm.COUNT_PROMPT}],  # type: ignore[arg-type]
        temperature=0,
        stream=True,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break  # the answer has started: leave mid-stream
    await stream.close()

    generate = next(c for c in mlx_proxy.calls[before:] if c.method == GENERATE)
    request_id = pb.GenerateRequest.FromString(generate.request).request_id
    abort = await mlx_proxy.wait_for(
        lambda: next(
            (
                c
                for c in mlx_proxy.calls[before:]
                if c.method == ABORT and request_id in pb.AbortRequest.FromString(c.request).request_ids
            ),
            None,
        )
    )
    await asyncio.wait_for(abort.done.wait(), 10)
    assert abort.code.name == "OK"  # the engine took the Abort
    await asyncio.wait_for(generate.done.wait(), 10)
    replies = [pb.GenerateResponse.FromString(r) for r in generate.responses]
    assert all(r.WhichOneof("response") == "chunk" for r in replies)  # it never finished the answer
    assert len(replies) < 60
    # The engine is free again and answers the next request in full.
    engine = mlx_gateway.state.fleet.all_workers()[0].client
    after = await mlx_client.chat.completions.create(
        model=model_name(tiny_model), messages=[{"role": "user", "content": tm.HELLO_PROMPT}], temperature=0
    )
    assert after.choices[0].message.content == tm.HELLO_ANSWER
    assert (await engine.server_info(timeout=5))["active_requests"] == 0


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_an_engine_killed_mid_stream_is_a_stream_error(
    api: str, tiny_model: Path, tmp_path: Path
) -> None:
    engine = await start_mlx_servicer(tiny_model, tmp_path)
    try:
        async with (
            running_gateway(real_settings(engine.url, max_retries=0)) as gw,  # type: ignore[arg-type]
            openai.AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0, timeout=60) as client,
        ):
            model = model_name(tiny_model)
            if api == "chat":
                stream = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": tm.COUNT_PROMPT}],
                    temperature=0,
                    stream=True,
                )
                with pytest.raises(openai.APIError):
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            engine.kill()
            else:
                stream = await client.responses.create(
                    model=model, input=tm.COUNT_PROMPT, temperature=0, stream=True, store=False
                )
                terminal = None
                async for event in stream:
                    if event.type == "response.output_text.delta" and engine.process.poll() is None:
                        engine.kill()
                    terminal = event.type
                assert terminal == "response.failed"
            assert engine.process.returncode == -signal.SIGKILL
    finally:
        engine.stop()
