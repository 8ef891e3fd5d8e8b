"""Failures nobody planned for: a gateway bug or a dependency's panic (openai-harmony's is a pyo3
`PanicException`, which derives from BaseException and so passes every `except Exception`). Known panics
are prevented or mapped to 400s (tests/e2e/test_fuzz_routes.py TRAPS); here the generation step raises a
real openai-harmony panic class, to prove what any other failure gets:

- Before the response starts: a 500 with the wire's error body (OpenAI's names the request id), and one
  log line (no traceback above debug level, nothing from the server about an exception in the ASGI app).
- After it started: the stream ends with the wire's error frame, and one log line.
- In a background response: it ends `failed`, stored with its error, and its event stream (live and
  replayed) ends with `response.failed`; nothing stays `in_progress`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

import harmony_gateway.surfaces.chat.run as run_module
import harmony_gateway.surfaces.messages.run as anthropic_module
import harmony_gateway.surfaces.responses.service.turns as turns_module
from harmony_gateway.errors import is_failure, is_panic
from harmony_gateway.harmony.encoding import get_encoding
from tests.conftest import MODEL
from tests.support.responses_stream import validate_event_stream
from tests.support.servers import RunningGateway, wait_until

TIMEOUT = 30.0
PANIC_MESSAGE = "called `Result::unwrap()` on an `Err` value: RuntimeError(StackOverflow)"
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def panic_type() -> type[BaseException]:
    """The class of a real openai-harmony panic (on a run of letters its pre-tokenizer cannot split)."""
    try:
        get_encoding().encode("x" * 1_000_000, allowed_special=set(), disallowed_special=())
    except BaseException as exc:
        assert is_panic(exc) and is_failure(exc) and not isinstance(exc, Exception)
        return type(exc)
    pytest.fail("openai-harmony no longer panics on a million-letter word: pick another trigger")


@pytest.fixture
async def http(gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=TIMEOUT) as c:
        yield c


def raising(panic_type: type[BaseException]) -> Any:
    """An `open_generation` that panics before any output."""

    async def open_generation(*_args: Any, **_kwargs: Any) -> Any:
        raise panic_type(PANIC_MESSAGE)

    return open_generation


def raising_after_the_first_chunk(panic_type: type[BaseException], real: Any) -> Any:
    """An `open_generation` whose stream panics after its first real chunk."""

    async def open_generation(*args: Any, **kwargs: Any) -> Any:
        source = await real(*args, **kwargs)

        async def first_then_panic() -> AsyncIterator[Any]:
            async with contextlib.aclosing(source):
                yield await anext(source)
                raise panic_type(PANIC_MESSAGE)

        return first_then_panic()

    return open_generation


@pytest.fixture
def panicking_turns(monkeypatch: pytest.MonkeyPatch, panic_type: type[BaseException]) -> None:
    """The generations of a background response's turns panic."""
    monkeypatch.setattr(turns_module, "open_generation", raising(panic_type))


def sse_events(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[5:])
        for line in text.splitlines()
        if line.startswith("data:") and "[DONE]" not in line
    ]


def assert_one_line_about(caplog: pytest.LogCaptureFixture, *needles: str) -> None:
    records = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "no API keys" not in r.getMessage()
    ]
    assert len(records) == 1, [r.getMessage()[:200] for r in records]
    line = records[0].getMessage()
    assert all(needle in line for needle in needles), line
    assert len(line) < 500 and "\n" not in line
    assert not [r for r in caplog.records if r.exc_info and r.levelno > logging.DEBUG]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_panic_before_the_response_is_a_clean_500_with_one_log_line(
    http: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
    panic_type: type[BaseException],
    caplog: pytest.LogCaptureFixture,
    stream: bool,
) -> None:
    monkeypatch.setattr(run_module, "open_generation", raising(panic_type))
    caplog.set_level(logging.INFO)
    body = {"model": MODEL, "messages": USER, "stream": stream}
    with anyio.fail_after(TIMEOUT):
        response = await http.post("/v1/chat/completions", json=body, headers={"x-request-id": "rid-panic"})
    assert response.status_code == 500, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"] == "rid-panic"
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error" and error["param"] is None
    assert "rid-panic" in error["message"]
    assert_one_line_about(caplog, "rid-panic", "PanicException", "StackOverflow")
    monkeypatch.undo()
    healthy = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert healthy.status_code == 200, healthy.text


async def test_a_panic_on_the_anthropic_wire_is_its_own_500(
    http: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
    panic_type: type[BaseException],
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(anthropic_module, "open_generation", raising(panic_type))
    caplog.set_level(logging.INFO)
    body = {"model": MODEL, "max_tokens": 64, "messages": USER}
    with anyio.fail_after(TIMEOUT):
        response = await http.post("/v1/messages", json=body, headers={"x-request-id": "rid-anthropic"})
    assert response.status_code == 500, response.text
    assert response.json() == {
        "type": "error",
        "error": {"type": "api_error", "message": "internal error (request id rid-anthropic)"},
    }
    assert response.headers["request-id"] == "rid-anthropic"
    assert response.headers["x-should-retry"] == "false"
    assert_one_line_about(caplog, "rid-anthropic", "PanicException")


async def test_a_panic_mid_stream_ends_the_stream_with_the_wire_error(
    http: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
    panic_type: type[BaseException],
    caplog: pytest.LogCaptureFixture,
) -> None:
    panicking = raising_after_the_first_chunk(panic_type, run_module.open_generation)
    monkeypatch.setattr(run_module, "open_generation", panicking)
    caplog.set_level(logging.INFO)
    body = {"model": MODEL, "messages": USER, "stream": True}
    with anyio.fail_after(TIMEOUT):
        response = await http.post("/v1/chat/completions", json=body, headers={"x-request-id": "rid-mid"})
    assert response.status_code == 200
    assert response.text.rstrip().endswith("data: [DONE]")
    assert sse_events(response.text)[-1]["error"]["code"] == "internal_error"
    assert_one_line_about(caplog, "rid-mid", "PanicException")


async def test_a_panic_in_a_background_response_fails_it_and_ends_its_streams(
    http: httpx.AsyncClient, panicking_turns: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    body = {"model": MODEL, "input": "Hello", "background": True, "stream": True}
    with anyio.fail_after(TIMEOUT):
        live = await http.post("/v1/responses", json=body)
    assert live.status_code == 200, live.text
    events = sse_events(live.text)
    validate_event_stream(events)
    assert events[-1]["type"] == "response.failed"
    response_id = events[0]["response"]["id"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"

    stored = (await http.get(f"/v1/responses/{response_id}")).json()
    assert stored["status"] == "failed" and stored["error"] == failed["error"]
    with anyio.fail_after(TIMEOUT):
        replay = await http.get(f"/v1/responses/{response_id}", params={"stream": "true"})
    assert sse_events(replay.text) == events
    assert_one_line_about(caplog, response_id, "PanicException")


async def test_a_panic_in_a_polled_background_response_fails_it(
    http: httpx.AsyncClient, gateway: RunningGateway, panicking_turns: None
) -> None:
    queued = (
        await http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "background": True})
    ).json()
    assert queued["status"] == "queued"
    await wait_until(lambda: not gateway.state.background.running(queued["id"]), timeout=TIMEOUT)
    stored = (await http.get(f"/v1/responses/{queued['id']}")).json()
    assert stored["status"] == "failed" and stored["error"]["code"] == "server_error"
    with anyio.fail_after(TIMEOUT):
        replay = await http.get(f"/v1/responses/{queued['id']}", params={"stream": "true"})
    assert sse_events(replay.text)[-1]["type"] == "response.failed"
