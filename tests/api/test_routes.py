"""The SSE response of a route: a stream cut from outside is numbered after what its writer took, not
after what its framer ran ahead to (the framer runs in its own task, `coalesce`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from harmony_gateway.api.routes import sse_response
from harmony_gateway.errors import Overloaded
from harmony_gateway.pipeline.context import RequestContext
from harmony_gateway.wire import RESPONSES


async def test_a_cut_stream_is_numbered_after_the_last_piece_the_writer_took() -> None:
    ctx = RequestContext(request_id="r", route="responses", wire=RESPONSES)
    resume = asyncio.Event()
    framed_ahead = asyncio.Event()

    async def framed() -> AsyncGenerator[bytes, None]:
        ctx.next_sequence = 3  # events 0..2 in the first piece
        yield b"first"
        await resume.wait()
        ctx.next_sequence = 7  # events 3..6, framed while the writer is still busy with the first piece
        yield b"second"
        framed_ahead.set()
        await asyncio.Event().wait()

    body = sse_response(framed(), ctx).body_iterator
    assert await anext(body) == b"first"  # type: ignore[call-overload]
    resume.set()
    await framed_ahead.wait()
    await body.aclose()  # type: ignore[attr-defined]  # the cut: "second" never reaches the client

    assert (ctx.next_sequence, ctx.sent_sequence) == (7, 3)
    exc = Overloaded("the gateway shut down before this response finished", code="shutting_down")
    assert ctx.cut_frame(exc) == RESPONSES.stream_error(exc, 3)
