"""--stream-interval: the engine sends one message per N tokens; the client still gets identical text."""

from __future__ import annotations

import openai

from tests.conftest import MODEL
from tests.support.servers import running_gateway, test_settings


async def test_stream_interval_reaches_the_engine_and_keeps_text(sim) -> None:
    async with running_gateway(test_settings(worker_urls=(sim.url,), stream_interval=4)) as gw:
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
            messages = [{"role": "user", "content": "[[unicode]] stream this in batches"}]
            whole = await client.chat.completions.create(model=MODEL, messages=messages)
            assert sim.requests[-1].sampling.get("stream_interval") is None  # non-stream: not asked
            stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
            content, reasoning = [], []
            async for chunk in stream:
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is not None:
                    content.append(delta.content or "")
                    reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
            assert sim.requests[-1].sampling.get("stream_interval") == 4
            assert "".join(content) == whole.choices[0].message.content
            assert "".join(reasoning) == whole.choices[0].message.model_extra["reasoning_content"]


def test_adaptive_interval_grows_with_load() -> None:
    from harmony_gateway.pipeline.dispatch import adaptive_stream_interval

    assert [adaptive_stream_interval(n) for n in (0, 7, 8, 31, 32, 500)] == [1, 1, 2, 2, 4, 4]


def test_cli_accepts_auto_and_numbers_only() -> None:
    import pytest

    from harmony_gateway.cli import build_parser, settings_from_args

    def parse(value: str) -> int | None:
        args = build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", "--stream-interval", value])
        return settings_from_args(args).stream_interval

    assert parse("auto") == 0 and parse("4") == 4
    with pytest.raises(SystemExit):
        parse("0")


async def test_auto_interval_is_one_when_idle(sim) -> None:
    async with running_gateway(test_settings(worker_urls=(sim.url,), stream_interval=0)) as gw:
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            async for _ in stream:
                pass
    assert sim.requests[-1].sampling.get("stream_interval") == 1
