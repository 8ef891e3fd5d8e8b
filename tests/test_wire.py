"""Each wire as data: an exception in, the HTTP status and body before the first byte, or the terminal
frame of a stream after it, out; and the one table that names the wire of each generating route."""

from __future__ import annotations

import orjson
import pytest

from harmony_gateway.errors import (
    Conflict,
    InternalError,
    InvalidRequest,
    NoHealthyWorker,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    UpstreamBadOutput,
    UpstreamTimeout,
)
from harmony_gateway.pipeline.context import RequestContext
from harmony_gateway.surfaces.table import SURFACES, route_map
from harmony_gateway.wire import ANTHROPIC, OPENAI, RESPONSES, error_headers
from tests.support.published_schemas import assert_valid_event

INTERNAL = {"message": "internal error", "type": "server_error", "param": None, "code": "internal_error"}


def _events(frame: bytes) -> list[tuple[str | None, object]]:
    """(event name or None, decoded data) of each SSE event in `frame`."""
    out: list[tuple[str | None, object]] = []
    for block in frame.decode().split("\n\n"):
        if not block:
            continue
        name = None
        data = None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:] if line[6:] == "[DONE]" else orjson.loads(line[6:])
        out.append((name, data))
    assert frame.endswith(b"\n\n")
    return out


# -- OpenAI: chat completions, completions, /generate ----------------------------------------------------
def test_openai_answers_a_gateway_error_with_its_own_status_and_error_object() -> None:
    status, body = OPENAI.error_response(InvalidRequest("n must be at least 1", param="n"))
    assert status == 400
    assert body == {
        "error": {
            "message": "n must be at least 1",
            "type": "invalid_request_error",
            "param": "n",
            "code": None,
        }
    }
    assert OPENAI.error_body(InvalidRequest("n must be at least 1", param="n")) == (400, orjson.dumps(body))


def test_openai_answers_anything_else_with_an_opaque_500() -> None:
    assert OPENAI.error_response(RuntimeError("a bug with secrets")) == (500, {"error": INTERNAL})


def test_openai_ends_a_stream_with_an_error_chunk_then_done_and_ignores_numbering() -> None:
    exc = Overloaded("the gateway shut down", code="shutting_down")
    frame = OPENAI.stream_error(exc, 17)
    assert _events(frame) == [
        (
            None,
            {
                "error": {
                    "message": "the gateway shut down",
                    "type": "server_error",
                    "param": None,
                    "code": "shutting_down",
                }
            },
        ),
        (None, "[DONE]"),
    ]
    assert OPENAI.stream_error(exc, 0) == frame
    assert _events(OPENAI.stream_error(ValueError("x"), 0))[0] == (
        None,
        {"error": dict(INTERNAL, message="internal error while streaming")},
    )


# -- Responses --------------------------------------------------------------------------------------------
def test_responses_answers_before_the_first_byte_as_openai_does() -> None:
    for exc in (InvalidRequest("bad", param="input"), NoHealthyWorker("none"), RuntimeError("bug")):
        assert RESPONSES.error_response(exc) == OPENAI.error_response(exc)


def test_responses_ends_a_stream_with_an_error_event_numbered_next() -> None:
    """Both published shapes at once: OpenAI's fields on the event, Open Responses' nested `error`."""
    frame = RESPONSES.stream_error(Overloaded("the gateway shut down", code="shutting_down"), 42)
    error = {"code": "shutting_down", "message": "the gateway shut down", "param": None}
    assert _events(frame) == [
        (
            "error",
            {"type": "error", **error, "error": {"type": "server_error", **error}, "sequence_number": 42},
        )
    ]
    bug = _events(RESPONSES.stream_error(RuntimeError("bug"), 3))
    error = {"code": "internal_error", "message": "internal error while streaming", "param": None}
    assert bug == [
        (
            "error",
            {"type": "error", **error, "error": {"type": "server_error", **error}, "sequence_number": 3},
        )
    ]
    invalid = _events(RESPONSES.stream_error(InvalidRequest("bad", param="input"), 0))
    assert invalid[0][1]["error"]["type"] == "invalid_request_error"
    for _, event in [*_events(frame), *bug, *invalid]:
        assert_valid_event(event)


@pytest.mark.parametrize(
    ("exc", "status", "error_type"),
    [
        (InvalidRequest("bad"), 400, "invalid_request_error"),
        (PayloadTooLarge("too big"), 413, "request_too_large"),
        (RateLimited("slow down"), 429, "rate_limit_error"),
        (NoHealthyWorker("none"), 529, "overloaded_error"),
        (Overloaded("draining", code="shutting_down"), 529, "overloaded_error"),
        (UpstreamTimeout("late"), 504, "timeout_error"),
        (UpstreamBadOutput("junk"), 502, "api_error"),
    ],
)
def test_anthropic_maps_statuses_to_its_own_table(exc: Exception, status: int, error_type: str) -> None:
    assert ANTHROPIC.error_response(exc) == (
        status,
        {"type": "error", "error": {"type": error_type, "message": str(exc)}},
    )


def test_anthropic_names_the_parameter_in_the_message_once() -> None:
    _, body = ANTHROPIC.error_response(InvalidRequest("must be positive", param="max_tokens"))
    assert body["error"]["message"] == "must be positive (at max_tokens)"
    _, body = ANTHROPIC.error_response(InvalidRequest("bad (at max_tokens)", param="max_tokens"))
    assert body["error"]["message"] == "bad (at max_tokens)"


def test_anthropic_answers_anything_else_with_an_api_error() -> None:
    assert ANTHROPIC.error_response(RuntimeError("a bug")) == (
        500,
        {"type": "error", "error": {"type": "api_error", "message": "internal error"}},
    )


def test_anthropic_ends_a_stream_with_an_error_event_and_ignores_numbering() -> None:
    frame = ANTHROPIC.stream_error(NoHealthyWorker("no worker"), 9)
    assert _events(frame) == [
        ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "no worker"}})
    ]
    assert ANTHROPIC.stream_error(NoHealthyWorker("no worker"), 0) == frame


# -- the route table and the request context ----------------------------------------------------------------
def test_every_generating_route_has_a_wire() -> None:
    routes = route_map()
    assert set(routes.generating) == {surface.path for surface in SURFACES}
    assert routes.wire("POST", "/v1/messages") is ANTHROPIC
    assert routes.wire("POST", "/v1/messages/count_tokens") is ANTHROPIC
    assert routes.wire("POST", "/v1/responses") is RESPONSES
    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        assert routes.wire("POST", path) is OPENAI


def test_a_route_without_a_row_answers_on_the_openai_wire() -> None:
    routes = route_map()
    assert routes.wire("GET", "/v1/models") is OPENAI
    assert routes.wire("GET", "/v1/messages") is OPENAI


def test_the_context_frames_errors_on_its_wire_from_the_framers_numbering() -> None:
    ctx = RequestContext(request_id="r", route="responses", wire=RESPONSES)
    ctx.next_sequence = 5  # the framer handed out events 0..4
    exc = Overloaded("cut", code="shutting_down")
    assert ctx.error_frame(exc) == RESPONSES.stream_error(exc, 5)
    # A cut from outside continues after what reached the client, not after what was framed.
    ctx.sent_sequence = 3
    assert ctx.cut_frame(exc) == RESPONSES.stream_error(exc, 3)
    plain = RequestContext(request_id="r", route="chat")
    assert plain.wire is OPENAI and plain.error_frame(exc) == OPENAI.stream_error(exc, 0)


# -- the headers of an error response ---------------------------------------------------------------------
def test_a_permanent_client_error_tells_the_sdks_not_to_retry() -> None:
    for exc in (Conflict("item already in the conversation"), InvalidRequest("bad"), PayloadTooLarge("big")):
        assert error_headers(OPENAI, exc, "r")["x-should-retry"] == "false"
        assert error_headers(ANTHROPIC, exc, "r")["x-should-retry"] == "false"


def test_an_error_that_says_when_to_come_back_may_be_retried() -> None:
    running = Conflict("previous response still running", retry_after=1.0)
    headers = error_headers(OPENAI, running, "r")
    assert "x-should-retry" not in headers and headers["retry-after"] == "1"
    limited = error_headers(OPENAI, RateLimited("slow down", retry_after=7.4), "r")
    assert "x-should-retry" not in limited
    assert (limited["retry-after"], limited["retry-after-ms"]) == ("7", "7400")
    assert error_headers(OPENAI, NoHealthyWorker("none"), "r")["retry-after"] == "1"


def test_a_gateway_bug_is_not_retried_and_names_its_request() -> None:
    headers = error_headers(ANTHROPIC, InternalError("internal error (request id r)"), "r")
    assert headers["x-should-retry"] == "false"
    assert headers["request-id"] == headers["x-request-id"] == "r"
    assert error_headers(OPENAI, InternalError("x"), "r") == {"x-request-id": "r", "x-should-retry": "false"}
