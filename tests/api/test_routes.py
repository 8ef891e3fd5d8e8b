"""The SSE response of a route: a stream cut from outside is numbered after the last piece its writer
took, not after what its framer went on to frame (`EventStreamResponse`: the writing task pulls each
piece from the framer and numbers what it sends)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from harmony_gateway.api.routes import sse_response
from harmony_gateway.errors import Overloaded
from harmony_gateway.pipeline.context import RequestContext
from harmony_gateway.wire import RESPONSES


async def test_a_cut_stream_is_numbered_after_the_last_piece_the_writer_took() -> None:
    ctx = RequestContext(request_id="r", route="responses", wire=RESPONSES)
    framing_more = asyncio.Event()
    client_left = asyncio.Event()
    sent: list[bytes] = []

    async def framed() -> AsyncGenerator[bytes, None]:
        ctx.next_sequence = 3  # events 0..2 in the first piece
        yield b"first"
        ctx.next_sequence = 7  # events 3..6 framed, not yet handed to the writer, when the client leaves
        framing_more.set()
        await asyncio.Event().wait()
        yield b"second"

    async def receive() -> dict[str, Any]:
        await client_left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    response = asyncio.ensure_future(sse_response(framed(), ctx)({"type": "http"}, receive, send))
    await framing_more.wait()
    client_left.set()  # the cut: "second" never reaches the client
    await response

    assert sent == [b"first"]
    assert (ctx.next_sequence, ctx.sent_sequence) == (7, 3)
    exc = Overloaded("the gateway shut down before this response finished", code="shutting_down")
    assert ctx.cut_frame(exc) == RESPONSES.stream_error(exc, 3)
