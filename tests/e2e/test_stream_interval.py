"""--stream-interval: the engine sends one message per N tokens; the client still gets identical text."""

from __future__ import annotations

import openai

from harmony_gateway.pipeline.stream_interval import MAX_INTERVAL, VISIBLE_GAP_SECONDS, StreamIntervalTuner
from harmony_gateway.routing.workers import Worker
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


def _worker() -> Worker:
    return Worker("grpc://w:1", client=None)  # type: ignore[arg-type]


def test_auto_interval_follows_the_decode_rate() -> None:
    tuner, worker = StreamIntervalTuner(), _worker()
    assert tuner.interval_for(worker) == 1  # not measured yet: one token per message
    for _ in range(200):
        tuner.observe(worker, 0.020, 1)  # 50 tokens/s: any coarser would show
    assert tuner.interval_for(worker) == 1
    for _ in range(600):
        tuner.observe(worker, 0.004, 4)  # 1000 tokens/s, four tokens a message
    assert tuner.interval_for(worker) == int(VISIBLE_GAP_SECONDS / 0.001)
    for _ in range(400):
        tuner.observe(worker, 0.00001, 1)
    assert tuner.interval_for(worker) == MAX_INTERVAL
    tuner.observe(worker, 5.0, 0)  # the closing message carries no tokens: no sample
    assert tuner.interval_for(worker) == MAX_INTERVAL


def test_auto_interval_grows_while_the_loop_lags_and_shrinks_after() -> None:
    tuner, worker = StreamIntervalTuner(), _worker()
    for _ in range(200):
        tuner.observe(worker, 0.020, 1)
    for _ in range(4):
        tuner.note_lag(0.050)  # a burst, not saturation
    tuner.note_lag(0.0)
    assert tuner.interval_for(worker) == 1
    for _ in range(5):
        tuner.note_lag(0.050)
    assert tuner.interval_for(worker) == 2
    for _ in range(5 * 10):
        tuner.note_lag(0.050)
    assert tuner.interval_for(worker) == MAX_INTERVAL
    for _ in range(15 * 10):
        tuner.note_lag(0.0)
    assert tuner.interval_for(worker) == 1


def test_cli_accepts_auto_and_numbers_only() -> None:
    import pytest

    from harmony_gateway.cli import build_parser, settings_from_args
    from harmony_gateway.cli.checks import StartupError

    def parse(value: str) -> int | None:
        args = build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", "--stream-interval", value])
        return settings_from_args(args).stream_interval

    assert parse("auto") == 0 and parse("4") == 4 and parse("engine") is None
    default = build_parser().parse_args(["serve", "--worker-url", "grpc://h:1"])
    assert settings_from_args(default).stream_interval == 0
    # A bad value is a start-up error: `serve` prints it as one line and exits 2 (tests/test_cli_startup.py).
    with pytest.raises(StartupError, match="--stream-interval 0"):
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
