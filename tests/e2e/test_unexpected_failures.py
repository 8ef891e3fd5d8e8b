"""Failures nobody planned for: a gateway bug or a dependency's panic (openai-harmony's is a pyo3
`PanicException`, which derives from BaseException and so passes every `except Exception`).

- Before the response starts: a 500 with the OpenAI error body naming the request id, and one log line
  (no traceback above debug level, nothing from the server about an exception in the ASGI app).
- In a background response: it ends `failed`, stored with its error, and its event stream (live and
  replayed) ends with `response.failed`; nothing stays `in_progress`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest

import harmony_gateway.responses.turns as turns_module
from harmony_gateway.errors import is_panic
from harmony_gateway.harmony.encoding import get_encoding
from tests.conftest import MODEL
from tests.support.responses_stream import validate_event_stream
from tests.support.servers import RunningGateway, wait_until

TIMEOUT = 30.0
#: A run of letters openai-harmony's pre-tokenizer cannot split: it panics on it.
PANICKING_TEXT = "x" * 1_000_000


@pytest.fixture(scope="module")
def panic_type() -> type[BaseException]:
    """The class of a real openai-harmony panic, caught once."""
    try:
        get_encoding().encode(PANICKING_TEXT, allowed_special=set(), disallowed_special=())
    except BaseException as exc:
        assert is_panic(exc) and not isinstance(exc, Exception)
        return type(exc)
    pytest.fail("openai-harmony no longer panics on a million-letter word: pick another trigger")


@pytest.fixture
async def http(gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture
def panicking_generation(monkeypatch: pytest.MonkeyPatch, panic_type: type[BaseException]) -> Iterator[None]:
    """The generations of a response's turns fail with a real openai-harmony panic class."""

    async def panic(*_args: Any, **_kwargs: Any) -> Any:
        raise panic_type("called `Result::unwrap()` on an `Err` value: RuntimeError(StackOverflow)")

    monkeypatch.setattr(turns_module, "open_generation", panic)
    yield


def sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def failure_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING and "no API keys" not in r.getMessage()]


async def test_a_dependency_panic_is_a_clean_500_with_one_log_line(
    http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """`/generate` encodes its text prompt with openai-harmony, which panics on this one."""
    caplog.set_level(logging.INFO)
    with anyio.fail_after(TIMEOUT):
        response = await http.post(
            "/generate", json={"text": PANICKING_TEXT}, headers={"x-request-id": "rid-panic"}
        )
    assert response.status_code == 500, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"] == "rid-panic"
    assert response.headers["x-should-retry"] == "false"
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error" and error["param"] is None
    assert "rid-panic" in error["message"]
    records = failure_records(caplog)
    assert len(records) == 1, [r.getMessage()[:200] for r in records]
    line = records[0].getMessage()
    assert "rid-panic" in line and "PanicException" in line and "StackOverflow" in line
    assert len(line) < 500 and "\n" not in line
    assert not [r for r in caplog.records if r.exc_info and r.levelno > logging.DEBUG]
    healthy = await http.post("/generate", json={"text": "<|start|>user<|message|>Hi<|end|>"})
    assert healthy.status_code == 200, healthy.text


async def test_a_panic_in_a_background_response_fails_it_and_ends_its_streams(
    http: httpx.AsyncClient, panicking_generation: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    body = {"model": MODEL, "input": "Hello", "background": True, "stream": True}
    with anyio.fail_after(TIMEOUT):
        live = await http.post("/v1/responses", json=body)
    assert live.status_code == 200, live.text
    events = sse_events(live.text)
    validate_event_stream(events)
    assert [e["type"] for e in events][-1] == "response.failed"
    response_id = events[0]["response"]["id"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"

    stored = (await http.get(f"/v1/responses/{response_id}")).json()
    assert stored["status"] == "failed" and stored["error"] == failed["error"]
    with anyio.fail_after(TIMEOUT):
        replay = await http.get(f"/v1/responses/{response_id}", params={"stream": "true"})
    assert sse_events(replay.text) == events

    records = failure_records(caplog)
    assert len(records) == 1 and response_id in records[0].getMessage(), [r.getMessage() for r in records]
    assert not [r for r in caplog.records if r.exc_info and r.levelno > logging.DEBUG]


async def test_a_panic_in_a_polled_background_response_fails_it(
    http: httpx.AsyncClient, gateway: RunningGateway, panicking_generation: None
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
