"""The stream driver as data: a scripted source and a framer that records what the driver asked of it.

`drive` (a streamed body), `collect` (a JSON body) and `answer` (the one run of every surface) are
checked without an engine: which bytes go out in which order, when `settle` runs, when the source is
closed, what a failure or a cancellation does and what lands on the request context."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import pytest

from harmony_gateway.errors import UpstreamTimeout
from harmony_gateway.pipeline.context import RequestContext
from harmony_gateway.pipeline.drive import Generation, answer, collect, drive


class RecordingFramer:
    """A `Framer[str]`: an item's bytes are its own text; `settles` names the items (and "tail",
    "error") after which the framer has asynchronous work; `stop_after` the item that ends every choice."""

    def __init__(self, *, settles: Sequence[str] = (), stop_after: str | None = None, tail: bytes = b"T"):
        self.calls: list[str] = []
        self.fed: list[str] = []
        self.unsettled = False
        self.tokens = 0
        self._settles = set(settles)
        self._stop_after = stop_after
        self._tail = tail

    def feed(self, item: str) -> bytes:
        self.calls.append(f"feed {item}")
        self.fed.append(item)
        self.tokens += 1
        self.unsettled = item in self._settles
        return item.encode()

    def stopped(self) -> bool:
        return self._stop_after is not None and self._stop_after in self.fed

    def tail(self) -> bytes:
        self.calls.append("tail")
        self.unsettled = "tail" in self._settles
        return self._tail

    def error(self, exc: BaseException) -> bytes:
        self.calls.append(f"error {type(exc).__name__}")
        self.unsettled = "error" in self._settles
        return b"E:" + type(exc).__name__.encode()

    def completion_tokens(self) -> int:
        self.calls.append("completion_tokens")
        return self.tokens

    async def settle(self) -> None:
        self.calls.append("settle")
        self.unsettled = False


class Source:
    """An engine-like source: yields `items`, then raises `fail` if given; records how far it was read
    and whether its clean-up (`finally`, where an engine client aborts its request) ran."""

    def __init__(self, items: Sequence[str], fail: BaseException | None = None) -> None:
        self.items = list(items)
        self.fail = fail
        self.read: list[str] = []
        self.closed = False

    async def __call__(self) -> AsyncIterator[str]:
        try:
            for item in self.items:
                self.read.append(item)
                yield item
            if self.fail is not None:
                raise self.fail
        finally:
            self.closed = True


def context() -> RequestContext:
    return RequestContext(request_id="req-1", route="chat")


async def pieces(body: AsyncGenerator[bytes, None]) -> list[bytes]:
    return [piece async for piece in body]


# -- drive ------------------------------------------------------------------------------------------
async def test_drive_sends_the_head_with_the_first_frames_then_each_feed_then_the_tail() -> None:
    ctx, source, framer = context(), Source(["a", "b"]), RecordingFramer()
    assert await pieces(drive(ctx, source(), framer, b"H")) == [b"Ha", b"b", b"T"]
    assert framer.calls == ["feed a", "feed b", "completion_tokens", "tail"]
    assert source.closed


async def test_drive_skips_items_that_frame_nothing() -> None:
    """A chunk that completes no frame (half a token's text, a JSON body) sends no empty piece."""
    ctx, source, framer = context(), Source(["a", "", "", "b"]), RecordingFramer()
    assert await pieces(drive(ctx, source(), framer)) == [b"a", b"b", b"T"]
    assert framer.fed == ["a", "", "", "b"]


async def test_drive_settles_only_while_unsettled_and_before_the_bytes_go_out() -> None:
    ctx, source, framer = context(), Source(["a", "s", "b"]), RecordingFramer(settles=["s", "tail"])
    body = drive(ctx, source(), framer)
    seen: list[tuple[bytes, list[str]]] = [(piece, list(framer.calls)) async for piece in body]
    assert [piece for piece, _ in seen] == [b"a", b"s", b"b", b"T"]
    # When "s" went out its settle had run; when "b" went out no second settle had.
    assert seen[1][1] == ["feed a", "feed s", "settle"]
    assert seen[2][1] == ["feed a", "feed s", "settle", "feed b"]
    assert seen[3][1][-3:] == ["completion_tokens", "tail", "settle"]
    assert framer.calls.count("settle") == 2


async def test_drive_stops_reading_once_the_framer_has_stopped_and_closes_the_source() -> None:
    """A stop string ended every choice: the rest is not read, and closing the source aborts it."""
    ctx, source, framer = context(), Source(["a", "b", "c", "d"]), RecordingFramer(stop_after="b")
    assert await pieces(drive(ctx, source(), framer)) == [b"a", b"b", b"T"]
    assert source.read == ["a", "b"]
    assert source.closed
    assert ctx.completion_tokens == 2


async def test_drive_records_completion_tokens_once_at_the_end() -> None:
    ctx, source, framer = context(), Source(["a", "b", "c"]), RecordingFramer()
    body = drive(ctx, source(), framer)
    assert await anext(body) == b"a"
    assert ctx.completion_tokens == 0  # nothing recorded while the stream runs
    await pieces(body)
    assert ctx.completion_tokens == 3
    assert framer.calls.count("completion_tokens") == 1


async def test_a_gateway_error_mid_stream_becomes_the_error_frame_and_its_status() -> None:
    ctx = context()
    source, framer = Source(["a"], fail=UpstreamTimeout("no token in time")), RecordingFramer()
    assert await pieces(drive(ctx, source(), framer)) == [b"a", b"E:UpstreamTimeout"]
    assert ctx.status == 504
    assert ctx.completion_tokens == 1
    assert "tail" not in framer.calls
    assert source.closed


async def test_the_error_frame_goes_out_after_its_settle() -> None:
    """A stored response is written as failed before the client hears `response.failed`."""
    ctx = context()
    source, framer = Source(["a"], fail=UpstreamTimeout("slow")), RecordingFramer(settles=["error"])
    body = drive(ctx, source(), framer)
    assert await anext(body) == b"a"
    assert await anext(body) == b"E:UpstreamTimeout"
    assert framer.calls[-2:] == ["error UpstreamTimeout", "settle"]


async def test_any_other_failure_is_a_500_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    ctx = context()
    source, framer = Source(["a"], fail=RuntimeError("a gateway bug")), RecordingFramer()
    with caplog.at_level(logging.ERROR, logger="harmony_gateway.pipeline.drive"):
        assert await pieces(drive(ctx, source(), framer)) == [b"a", b"E:RuntimeError"]
    assert ctx.status == 500
    assert source.closed
    assert any("req-1" in r.getMessage() and "a gateway bug" in r.getMessage() for r in caplog.records)


async def test_cancellation_propagates_without_an_error_frame_and_closes_the_source() -> None:
    """A client that leaves cancels the body: no error frame, no status, and the source (the engine
    request) is closed."""
    waiting, closed = asyncio.Event(), asyncio.Event()

    async def stalled() -> AsyncIterator[str]:
        try:
            yield "a"
            waiting.set()
            await asyncio.Event().wait()  # the engine goes quiet
            yield "never"
        finally:
            closed.set()

    ctx, framer = context(), RecordingFramer()
    received: list[bytes] = []

    async def consume() -> None:
        async for piece in drive(ctx, stalled(), framer):
            received.append(piece)

    task = asyncio.create_task(consume())
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert received == [b"a"]
    assert closed.is_set()
    assert not any(call.startswith("error") for call in framer.calls)
    assert ctx.status == 200
    assert ctx.completion_tokens == 1  # what the client got is still counted (and charged)


async def test_a_cancelled_error_raised_by_the_source_propagates() -> None:
    ctx, source, framer = context(), Source(["a"], fail=asyncio.CancelledError()), RecordingFramer()
    body = drive(ctx, source(), framer)
    assert await anext(body) == b"a"
    with pytest.raises(asyncio.CancelledError):
        await anext(body)
    assert source.closed
    assert framer.calls == ["feed a", "completion_tokens"]
    assert ctx.completion_tokens == 1


async def test_a_consumer_that_stops_early_closes_the_source() -> None:
    ctx, source, framer = context(), Source(["a", "b", "c"]), RecordingFramer()
    body = drive(ctx, source(), framer)
    assert await anext(body) == b"a"
    await body.aclose()
    assert source.closed
    assert source.read == ["a"]
    assert framer.calls == ["feed a", "completion_tokens"]
    assert ctx.completion_tokens == 1  # a client that leaves is charged what it got


# -- collect ----------------------------------------------------------------------------------------
async def test_collect_feeds_every_item_and_settles_without_framing_the_end() -> None:
    source, framer = Source(["a", "s", "b"]), RecordingFramer(settles=["s"])
    await collect(source(), framer)
    assert framer.calls == ["feed a", "feed s", "settle", "feed b"]  # the body is built afterwards
    assert source.closed


async def test_collect_stops_reading_once_the_framer_has_stopped() -> None:
    source, framer = Source(["a", "b", "c"]), RecordingFramer(stop_after="a")
    await collect(source(), framer)
    assert source.read == ["a"]
    assert source.closed


async def test_collect_lets_a_failure_propagate_as_the_http_error() -> None:
    source, framer = Source(["a"], fail=UpstreamTimeout("slow")), RecordingFramer()
    with pytest.raises(UpstreamTimeout):
        await collect(source(), framer)
    assert framer.calls == ["feed a"]
    assert source.closed


# -- answer -----------------------------------------------------------------------------------------
async def _ready_stream() -> AsyncGenerator[bytes, None]:
    yield b"event"


@pytest.mark.parametrize("ready", [{"id": "resp_1", "status": "queued"}, [{"text": "x"}], _ready_stream()])
async def test_answer_returns_a_ready_answer_unchanged(ready: Any) -> None:
    assert await answer(context(), ready) is ready


async def test_answer_closes_the_plan_when_opening_fails_and_re_raises() -> None:
    ctx, framer, closed = context(), RecordingFramer(), []

    async def open_fails() -> AsyncIterator[str]:
        raise UpstreamTimeout("no first token")

    async def close() -> None:
        closed.append(True)

    with pytest.raises(UpstreamTimeout):
        await answer(ctx, Generation(open_fails, framer, close=close))
    assert closed == [True]
    assert ctx.cleanups == []
    assert framer.calls == []


async def test_answer_streams_with_the_head_read_after_open_and_close_as_a_cleanup() -> None:
    ctx, source, framer = context(), Source(["a", "b"]), RecordingFramer()
    order: list[str] = []

    async def open_source() -> AsyncIterator[str]:
        order.append("open")
        return source()

    def head() -> bytes:
        order.append("head")
        return b"H"

    async def close() -> None:
        order.append("close")

    body = await answer(ctx, Generation(open_source, framer, head=head, close=close))
    assert order == ["open", "head"]
    assert ctx.cleanups == [close]  # runs when the request ends, also if the stream never starts
    assert await pieces(body) == [b"Ha", b"b", b"T"]
    assert ctx.completion_tokens == 2


async def test_answer_builds_a_json_body_after_collecting_and_then_records_tokens() -> None:
    ctx, source, framer = context(), Source(["a", "b"]), RecordingFramer()

    async def open_source() -> AsyncIterator[str]:
        return source()

    async def body() -> dict[str, Any]:
        fed = list(framer.fed)
        framer.tokens = 7  # building the body may close the choices, which counts their last tokens
        return {"fed": fed}

    assert await answer(ctx, Generation(open_source, framer, body=body)) == {"fed": ["a", "b"]}
    assert ctx.completion_tokens == 7
    assert source.closed
    assert "tail" not in framer.calls


async def test_a_json_request_that_fails_part_way_still_records_what_was_generated() -> None:
    ctx, source, framer = context(), Source(["a", "b"], fail=UpstreamTimeout("slow")), RecordingFramer()

    async def open_source() -> AsyncIterator[str]:
        return source()

    async def body() -> dict[str, Any]:
        raise AssertionError("no body is built for a failed generation")

    with pytest.raises(UpstreamTimeout):
        await answer(ctx, Generation(open_source, framer, body=body))
    assert ctx.completion_tokens == 2  # charged to the token budget though the client gets an error
    assert source.closed
