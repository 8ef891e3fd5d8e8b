"""Bounded requests and connection hygiene, against a real gateway on loopback (README "Limits").

Each test reproduces one way a single client could stall or starve a shared gateway (an oversized or
trickled body, a slow or silent request head, huge headers, thousands of idle sockets, million-entry
lists, an unbounded conversation) and checks it is refused early, with an OpenAI error, while everyone
else keeps being served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import orjson
import pytest

from tests.conftest import MODEL
from tests.support.loop_stall import health_while
from tests.support.servers import RunningGateway, running_gateway, test_settings

SMALL_BODY_CAP = 1024 * 1024


@pytest.fixture(scope="module")
async def guarded(sim: Any) -> AsyncIterator[RunningGateway]:
    settings = test_settings(
        worker_urls=(sim.url,),
        max_body_bytes=SMALL_BODY_CAP,
        header_timeout=1.0,
        body_timeout=1.0,
        max_header_bytes=16 * 1024,
        max_headers=64,
    )
    async with running_gateway(settings) as gw:
        yield gw


def _address(gw: RunningGateway) -> tuple[str, int]:
    parts = urlsplit(gw.url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def _read_all(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or `timeout` passes)."""
    chunks = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while piece := await reader.read(65536):
                chunks.append(piece)
    return b"".join(chunks)


def _error_of(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, orjson.loads(body)["error"]


async def test_an_oversized_body_is_refused_before_it_is_read(guarded: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=guarded.url, timeout=30) as client:
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * SMALL_BODY_CAP}]})
        start = time.perf_counter()
        r = await client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert time.perf_counter() - start < 5

        async def chunked() -> AsyncIterator[bytes]:  # no content-length: counted as it arrives
            for _ in range(SMALL_BODY_CAP // 65536 + 2):
                yield b" " * 65536

        r = await client.post("/v1/chat/completions", content=chunked())
        assert r.status_code == 413
        assert r.json()["error"]["message"].startswith("the request body is larger")
        assert (await client.get("/health")).status_code == 200


async def test_an_oversized_messages_body_is_refused_in_anthropics_shape(guarded: RunningGateway) -> None:
    async with httpx.AsyncClient(base_url=guarded.url, timeout=30) as client:
        messages = [{"role": "user", "content": "x" * SMALL_BODY_CAP}]
        body = orjson.dumps({"model": MODEL, "max_tokens": 16, "messages": messages})
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 413
            assert r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "request_too_large"
            assert r.json()["error"]["message"].startswith("the request body is larger")


async def test_the_largest_allowed_request_never_stalls_the_event_loop(sim: Any) -> None:
    """A body just under the default 8 MiB cap: decoding, validating and rendering it take about a
    second of CPU, all off the event loop, while /health keeps answering."""
    async with running_gateway(test_settings(worker_urls=(sim.url,))) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
            content = "All work and no play makes Jack a dull boy. " * (8 * 1024 * 1024 // 45 - 100)
            body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})
            assert len(body) < 8 * 1024 * 1024
            post = client.post(
                "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            stall = await health_while(client, post, pause=0.01)
    # Rendered, then refused for the model's context length: all the expensive work was done.
    assert stall.response.status_code == 400
    assert stall.response.json()["error"]["code"] == "context_length_exceeded"
    assert len(stall.latencies) >= 3
    assert stall.longest_stall < 0.25, stall.intervals


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 4097},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}] * 513,
            },
            "tools",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": ["s"] * 17},
            "stop",
        ),
        ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": "x"}] * 4097}, "input"),
        (
            "/v1/responses",
            {"model": MODEL, "input": "x", "metadata": {f"k{i}": "v" for i in range(17)}},
            "metadata",
        ),
        ("/v1/responses", {"model": MODEL, "input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
        ("/v1/responses", {"model": MODEL, "input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 65}, "prompt"),
        ("/generate", {"text": ["hi"] * 65}, "text"),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "x"}],
                "stop_sequences": ["s"] * 17,
            },
            "stop_sequences",
        ),
        ("/v1/conversations", {"items": [{"type": "message", "role": "user", "content": "x"}] * 21}, "items"),
        ("/v1/conversations", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
async def test_each_cap_is_a_400_naming_the_field(
    guarded: RunningGateway, route: str, body: dict[str, Any], param: str
) -> None:
    async with httpx.AsyncClient(base_url=guarded.url, timeout=30) as client:
        r = await client.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "Value error" not in error["message"]
    if route == "/v1/messages":  # Anthropic's error object has no param: the message names the field
        assert param in error["message"]
    else:
        assert error["param"] == param


async def test_a_huge_list_is_refused_without_validating_its_entries(guarded: RunningGateway) -> None:
    body = orjson.dumps({"model": MODEL, "input": [{}] * 300_000})  # 900 kB, under this gateway's cap
    async with httpx.AsyncClient(base_url=guarded.url, timeout=30) as client:
        r = await client.post("/v1/responses", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input"
    assert r.json()["error"]["message"].startswith("at most 4096 input items are accepted, got 300000")


async def test_a_conversation_is_bounded(sim: Any) -> None:
    item = {"type": "message", "role": "user", "content": "hello"}
    async with (
        running_gateway(test_settings(worker_urls=(sim.url,), max_conversation_items=25)) as capped,
        openai.AsyncOpenAI(base_url=capped.base_url, api_key="k", max_retries=0) as client,
    ):
        conversation = await client.conversations.create(items=[item] * 20)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.conversations.items.create(conversation.id, items=[item] * 6)
        assert caught.value.param == "items"
        await client.conversations.items.create(conversation.id, items=[item] * 5)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model=MODEL, input="one more", conversation=conversation.id)
        assert caught.value.param == "conversation"
        listed = await client.conversations.items.list(conversation.id, limit=100)
        assert len(listed.data) == 25  # nothing was lost or added by the refusals


async def test_a_slow_request_head_gets_408_and_the_connection_closes(guarded: RunningGateway) -> None:
    reader, writer = await asyncio.open_connection(*_address(guarded))
    start = time.perf_counter()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"

    async def trickle() -> None:  # a slowloris client: one byte at a time, never finishing the head
        with contextlib.suppress(ConnectionError):
            for byte in head:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)

    feeder = asyncio.create_task(trickle())
    raw = await _read_all(reader, timeout=10)
    feeder.cancel()
    writer.close()
    assert time.perf_counter() - start < 5
    status, error = _error_of(raw)
    assert status == 408 and error["code"] == "request_timeout"


async def test_a_silent_socket_is_closed(guarded: RunningGateway) -> None:
    reader, writer = await asyncio.open_connection(*_address(guarded))
    raw = await _read_all(reader, timeout=10)
    writer.close()
    status, _ = _error_of(raw)
    assert status == 408


async def test_a_trickled_body_gets_408(guarded: RunningGateway) -> None:
    reader, writer = await asyncio.open_connection(*_address(guarded))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 100\r\n\r\n{"model": '
    )
    await writer.drain()
    raw = await _read_all(reader, timeout=10)
    writer.close()
    status, error = _error_of(raw)
    assert status == 408 and "--body-timeout" in error["message"]


@pytest.mark.parametrize(
    "headers",
    [
        [(f"x-h{i}", "v") for i in range(80)],
        [("x-big", "v" * (20 * 1024))],
    ],
    ids=["too many headers", "too large a header"],
)
async def test_header_limits_give_431(guarded: RunningGateway, headers: list[tuple[str, str]]) -> None:
    async with httpx.AsyncClient(base_url=guarded.url, timeout=10) as client:
        r = await client.get("/health", headers=headers)
        assert r.status_code == 431
        assert r.json()["error"]["code"] == "request_header_fields_too_large"
        assert (await client.get("/health")).status_code == 200


async def test_real_requests_are_served_beside_a_thousand_idle_sockets(sim: Any) -> None:
    async with running_gateway(test_settings(worker_urls=(sim.url,), header_timeout=30.0)) as gw:
        host, port = _address(gw)
        idle = [await asyncio.open_connection(host, port) for _ in range(1000)]
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
                for _ in range(3):
                    r = await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}]
                    )
                    assert r.choices[0].message.content
        finally:
            for _, writer in idle:
                writer.close()


async def test_a_client_leaving_mid_body_is_one_log_line(
    guarded: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    reader, writer = await asyncio.open_connection(*_address(guarded))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 1000\r\n\r\n{"model": '
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    async with asyncio.timeout(10):
        while not any(r.name == "harmony_gateway.requests" for r in caplog.records):
            await asyncio.sleep(0.02)
    about_it = ("harmony_gateway.requests", "harmony_gateway.api.error_responses")
    [line] = [r for r in caplog.records if r.name in about_it]
    assert (line.fields["status"], line.fields["route"]) == (499, "chat")  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if r.exc_info]
