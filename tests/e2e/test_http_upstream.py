"""HTTP upstreams through the gateway to the openai SDK: Harmony returned as raw text in awkward chunkings
(markers split mid-marker, stripped special tokens, an unknown channel, a missing `<|end|>`), tool calls,
pass-through with `--text-parser MODEL=off`, the chat API, a non-Harmony model, errors and metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from harmony_gateway.errors import InvalidRequest
from tests.support.openai_upstream import FakeUpstream, running_upstream
from tests.support.servers import RunningGateway, running_gateway, test_settings

HARMONY = "gpt-oss-test"
PLAIN = "qwen-http"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with running_upstream(FakeUpstream(models=(HARMONY, PLAIN))) as up:
        yield up


@pytest.fixture(scope="module")
async def http_gateway(upstream: FakeUpstream) -> AsyncIterator[RunningGateway]:
    settings = test_settings(
        worker_urls=(f"{upstream.url}?model={HARMONY}", f"{upstream.url}/v1?model={PLAIN}&api=chat"),
        reasoning_parsers={PLAIN: "think"},
    )
    async with running_gateway(settings) as gw:
        yield gw


@pytest.fixture
async def http_client(http_gateway: RunningGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=http_gateway.base_url, api_key="t", max_retries=0, timeout=30
    ) as c:
        yield c


async def ask(
    client: openai.AsyncOpenAI, text: str, *, stream: bool, model: str = HARMONY, **kw: Any
) -> dict[str, Any]:
    """content / reasoning / tool calls / finish reason, from a stream or a non-stream answer."""
    messages = [{"role": "user", "content": text}]
    if not stream:
        r = await client.chat.completions.create(model=model, messages=messages, **kw)
        m = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or ()]
        return {
            "content": m.content,
            "reasoning": m.model_extra.get("reasoning_content"),
            "calls": calls,
            "finish": r.choices[0].finish_reason,
            "usage": r.usage,
        }
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None, "usage": None}
    stream_ = await client.chat.completions.create(
        model=model, messages=messages, stream=True, stream_options={"include_usage": True}, **kw
    )
    async for chunk in stream_:
        if not chunk.choices:
            out["usage"] = chunk.usage
            continue
        choice = chunk.choices[0]
        out["content"] += choice.delta.content or ""
        out["reasoning"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        for call in choice.delta.tool_calls or ():
            name, args = out["calls"].get(call.index, ("", ""))
            out["calls"][call.index] = (call.function.name or name, args + (call.function.arguments or ""))
        out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [out["calls"][k] for k in sorted(out["calls"])]
    out["content"] = out["content"] or None
    out["reasoning"] = out["reasoning"] or None
    return out


STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])


@STREAM
async def test_split_markers(http_client: openai.AsyncOpenAI, upstream: FakeUpstream, stream: bool) -> None:
    out = await ask(http_client, "What is 2+2?", stream=stream)
    assert out["reasoning"] == "Let me think."
    assert out["content"] == "The answer is 4."
    assert out["finish"] == "stop" and out["calls"] == []
    assert out["usage"].completion_tokens == 20
    api, body = upstream.requests[-1]
    assert api == "completions"
    assert body["model"] == HARMONY
    assert body["skip_special_tokens"] is False
    assert body["prompt"].startswith("<|start|>system<|message|>")
    assert body["prompt"].endswith("What is 2+2?<|end|><|start|>assistant")


@STREAM
async def test_stripped_special_tokens(http_client: openai.AsyncOpenAI, stream: bool) -> None:
    out = await ask(http_client, "[[stripped]]", stream=stream)
    assert out["reasoning"] == "Let me think."
    assert out["content"] == "The answer is 4."


@STREAM
async def test_unknown_channel_is_reasoning(http_client: openai.AsyncOpenAI, stream: bool) -> None:
    out = await ask(http_client, "[[unknown]]", stream=stream)
    assert out["reasoning"] == "Hmm.Odd. "
    assert out["content"] == "Done."


@STREAM
async def test_missing_end(http_client: openai.AsyncOpenAI, stream: bool) -> None:
    out = await ask(http_client, "[[noend]]", stream=stream)
    assert out["reasoning"] == "Thinking"
    assert out["content"] == "Answer without end"


@STREAM
async def test_tool_call(http_client: openai.AsyncOpenAI, stream: bool) -> None:
    out = await ask(http_client, "Weather in Paris? [[tool]]", stream=stream, tools=[WEATHER_TOOL])
    assert out["reasoning"] == "Need the weather."
    assert out["calls"] == [("get_weather", '{"city":"Paris"}')]
    assert out["finish"] == "tool_calls"
    assert out["content"] is None


@STREAM
async def test_no_markers_fall_back_to_pass_through(http_client: openai.AsyncOpenAI, stream: bool) -> None:
    out = await ask(http_client, "[[plain]]", stream=stream)
    assert out["content"] == "Just plain text with no markers at all."
    assert out["reasoning"] is None


async def test_stop_string_on_answer_only(http_client: openai.AsyncOpenAI) -> None:
    out = await ask(http_client, "What is 2+2?", stream=True, stop=["is", "think"])
    assert out["reasoning"] == "Let me think."  # never cut
    assert out["content"] == "The answer "
    assert out["finish"] == "stop"


@STREAM
async def test_non_harmony_model_passes_through_with_think_parser(
    http_client: openai.AsyncOpenAI, upstream: FakeUpstream, stream: bool
) -> None:
    out = await ask(http_client, "[[think]]", stream=stream, model=PLAIN, temperature=0.5)
    assert out["reasoning"] == "Hmm, a greeting."
    assert out["content"] == "Plain answer."
    api, body = upstream.requests[-1]
    assert api == "chat" and body["model"] == PLAIN and body["temperature"] == 0.5
    assert body["messages"] == [{"role": "user", "content": "[[think]]"}]


async def test_upstream_reasoning_passes_through(upstream: FakeUpstream) -> None:
    async with running_upstream(FakeUpstream(models=(PLAIN,), structured_reasoning=True)) as up:
        async with running_gateway(test_settings(worker_urls=(up.url,))) as gw:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="t", max_retries=0) as client:
                for stream in (False, True):
                    out = await ask(client, "[[think]]", stream=stream, model=PLAIN)
                    assert out["reasoning"] == "Hmm, a greeting."
                    assert out["content"] == "Plain answer."


async def test_text_parser_off_passes_raw_text(upstream: FakeUpstream) -> None:
    settings = test_settings(worker_urls=(f"{upstream.url}?model={HARMONY}",), text_parsers={HARMONY: "off"})
    async with running_gateway(settings) as gw:
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="t", max_retries=0) as client:
            for stream in (False, True):
                out = await ask(client, "What is 2+2?", stream=stream)
                assert out["content"] == (
                    "<|channel|>analysis<|message|>Let me think.<|end|>"
                    "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>"
                )
                assert out["reasoning"] is None


async def test_harmony_over_the_chat_api(upstream: FakeUpstream) -> None:
    """`api=chat`: the chat request is forwarded and the Harmony text in `content` is parsed."""
    settings = test_settings(worker_urls=(f"{upstream.url}/v1/chat/completions?model={HARMONY}",))
    async with running_gateway(settings) as gw:
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="t", max_retries=0) as client:
            out = await ask(client, "[[stripped]] hello", stream=True)
    assert (out["reasoning"], out["content"]) == ("Let me think.", "The answer is 4.")
    assert upstream.requests[-1][0] == "chat"


async def test_upstream_errors(http_client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await ask(http_client, "[[http400]]", stream=False)
    assert "prompt is too silly" in bad.value.message
    with pytest.raises(openai.InternalServerError) as failed:
        await ask(http_client, "[[http500]]", stream=True)
    assert failed.value.status_code == 502
    assert "engine exploded" in failed.value.message
    with pytest.raises(openai.APIError, match="engine died mid-stream"):
        await ask(http_client, "[[midstream]]", stream=True)


async def test_metrics_count_text_parser_outcomes(
    http_client: openai.AsyncOpenAI, http_gateway: RunningGateway
) -> None:
    await ask(http_client, "[[unknown]]", stream=False)
    await ask(http_client, "[[plain]]", stream=False)
    await ask(http_client, "[[noend]]", stream=False)
    async with httpx.AsyncClient() as client:
        text = (await client.get(http_gateway.url + "/metrics")).text
    lines = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and line[0] != "#"
    }
    assert lines['gateway_harmony_channel_messages_total{channel="<unknown>"}'] >= 1
    assert lines['gateway_harmony_channel_messages_total{channel="final"}'] >= 1
    assert lines['gateway_harmony_marker_fallback_total{fallback="passthrough"}'] >= 1
    assert lines['gateway_harmony_channel_parse_errors_total{kind="text"}'] >= 1
    assert lines["gateway_harmony_reasoning_answer_ratio_count"] >= 3


async def test_worker_url_forms() -> None:
    from harmony_gateway.engines.http_upstream import HttpUpstreamClient

    clients = [
        HttpUpstreamClient("http://h:1/v1/chat/completions?model=m"),
        HttpUpstreamClient("https://h/v1/"),
        HttpUpstreamClient("http://h:2?api=completions"),
    ]
    assert [(c.base_url, c.api, c.model_name) for c in clients] == [
        ("http://h:1", "chat", "m"),
        ("https://h", "auto", None),
        ("http://h:2", "completions", None),
    ]
    for client in clients:
        await client.close()
    with pytest.raises(InvalidRequest):
        HttpUpstreamClient("http://h:2?api=grpc")


# -- routes other than chat -------------------------------------------------------------------------------
@pytest.fixture
async def raw_http(http_gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=http_gateway.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("model", [HARMONY, PLAIN])
async def test_generate_and_responses_are_clear_400s(
    raw_http: httpx.AsyncClient, upstream: FakeUpstream, model: str
) -> None:
    sent = len(upstream.requests)
    for path, body in (
        ("/generate", {"model": model, "text": "hello"}),
        ("/v1/responses", {"model": model, "input": "hello"}),
    ):
        r = await raw_http.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "model"
        if model == HARMONY:  # the Responses route names what other models lack first
            assert model in error["message"] and "HTTP upstream" in error["message"]
    assert len(upstream.requests) == sent  # refused before dispatch


@STREAM
async def test_completions_pass_through_to_the_upstream(
    http_client: openai.AsyncOpenAI, upstream: FakeUpstream, stream: bool
) -> None:
    kwargs: dict[str, Any] = {
        "model": PLAIN,
        "prompt": "Say it [[plain]]",
        "max_tokens": 50,
        "temperature": 0.3,
    }
    if stream:
        chunks = [c async for c in await http_client.completions.create(stream=True, **kwargs)]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = await http_client.completions.create(**kwargs)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.completion_tokens == 20
    assert text == "Just plain text with no markers at all."
    assert finish == "stop"
    api, body = upstream.requests[-1]
    assert api == "completions"
    assert body["model"] == PLAIN and body["prompt"] == "Say it [[plain]]"
    assert body["max_tokens"] == 50 and body["temperature"] == 0.3
    # A Harmony model's raw prompt is sent as is, with the raw-text extensions.
    r = await http_client.completions.create(model=HARMONY, prompt="<|start|>user<|message|>hi", max_tokens=9)
    assert r.choices[0].text == (
        "<|channel|>analysis<|message|>Let me think.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>"
    )
    body = upstream.requests[-1][1]
    assert body["prompt"] == "<|start|>user<|message|>hi" and body["skip_special_tokens"] is False
    with pytest.raises(openai.BadRequestError) as info:
        await http_client.completions.create(model=PLAIN, prompt="x", logprobs=1)
    assert info.value.body["param"] == "logprobs"  # type: ignore[index]


@STREAM
@pytest.mark.parametrize("model", [HARMONY, PLAIN])
async def test_messages_through_the_upstream(
    http_gateway: RunningGateway, upstream: FakeUpstream, stream: bool, model: str
) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "[[think]]" if model == PLAIN else "What is 2+2?"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    async with anthropic.AsyncAnthropic(base_url=http_gateway.url, api_key="t", max_retries=0) as client:
        if stream:
            async with client.messages.stream(**kwargs) as s:
                message = await s.get_final_message()
        else:
            message = await client.messages.create(**kwargs)
    expected = (
        ("Hmm, a greeting.", "Plain answer.") if model == PLAIN else ("Let me think.", "The answer is 4.")
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == expected
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 20
    api, body = upstream.requests[-1]
    assert api == ("chat" if model == PLAIN else "completions")


async def test_text_parser_window_setting() -> None:
    """`--text-parser-window-chars`: with no channel marker in the window, the Harmony text parser falls
    back to the `===FINAL===` marker found there (and counts it); the default window waits for the
    late channel marker instead."""
    late = "Preface.===FINAL===The answer, then a late <|channel|>final<|message|>marker.<|return|>"
    expected = {
        24: ("Preface.", "The answer, then a late <|channel|>final<|message|>marker.<|return|>"),
        256: (None, "Preface.===FINAL===The answer, then a late marker."),
    }
    async with running_upstream(FakeUpstream(models=(HARMONY,), long_text=late)) as up:
        for window, (reasoning, content) in expected.items():
            settings = test_settings(
                worker_urls=(f"{up.url}?model={HARMONY}",), text_parser_window_chars=window
            )
            async with running_gateway(settings) as gw:
                async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="t", max_retries=0) as client:
                    for stream in (False, True):
                        out = await ask(client, "[[long]]", stream=stream)
                        assert (out["reasoning"], out["content"]) == (reasoning, content)
                async with httpx.AsyncClient() as http:
                    metrics = (await http.get(gw.url + "/metrics")).text
            fell_back = 'gateway_harmony_marker_fallback_total{fallback="marker"} 2.0' in metrics
            assert fell_back == (window == 24)


@STREAM
@pytest.mark.parametrize(
    ("trigger", "content"),
    [
        ("[[bad_header]]", "Done."),
        ("[[doubled_start]]", "Done."),
        ("[[stray_text]]", "Done."),
        ("[[return_after_analysis]]", None),
    ],
)
async def test_malformed_shapes_on_the_text_path(
    http_client: openai.AsyncOpenAI, stream: bool, trigger: str, content: str | None
) -> None:
    """Harmony as text recovers like the token path: the answer is kept, misplaced text is never content."""
    out = await ask(http_client, trigger, stream=stream)
    assert out["content"] == content
    assert out["reasoning"] and out["reasoning"].startswith("Hmm.")
    assert "<|" not in (out["content"] or "") + out["reasoning"]
