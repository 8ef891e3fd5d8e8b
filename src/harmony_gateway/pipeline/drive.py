"""The stream driver: the one loop that owns the life of a generation once it is open.

A surface opens its engine stream(s) with `open_generation` (dispatch, then the first chunk, so a
failure before any output is an HTTP error) or with a `batch.Batch`, or brings a source of several
generations (a response's turns with the tool calls between them: surfaces/responses/service/turns.py, each generation
opened here too), and hands the source to `drive`
(a streamed body) or `collect` (a JSON body) together with its `Framer`: what turns chunks into that
wire's bytes, when every choice has stopped early (stop strings), the closing frames and the wire's
terminal error frame. The driver feeds every chunk, stops reading once the framer says so, closes the
source on every exit (which aborts the engine request: a client that left, a failure, an early stop),
turns a failure after the first byte into the framer's error frame, and records the request's
completion tokens once, a client that left or a failed JSON request included (what they used is charged
to their token budget).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from ..engines.base import EngineChunk
from ..errors import GatewayError, NoHealthyWorker, is_failure
from ..observability.logging import log_failure
from .context import GatewayState, PreparedRequest, RequestContext
from .dispatch import dispatch
from .reasoning_budget import with_reasoning_budget

if TYPE_CHECKING:
    from ..routing.workers import Worker

log = logging.getLogger(__name__)

Item = TypeVar("Item", contravariant=True)
T = TypeVar("T")


class Framer(Protocol[Item]):
    """A surface's side of a generation: parse what arrives and frame it for its wire.

    `feed` takes one item of the source (an engine chunk, or `(prompt index, chunk)` for a batch) and
    returns the bytes to send now (b"" for a JSON body, which is built from the framer afterwards)."""

    def feed(self, item: Item) -> bytes: ...

    def stopped(self) -> bool:
        """True once every choice has ended early (a stop string): the rest is not read (and aborted)."""
        ...

    def tail(self) -> bytes:
        """Closing frames after the last item (finish, usage, the end-of-stream marker)."""
        ...

    def error(self, exc: BaseException) -> bytes:
        """The wire's terminal error frame for a failure after the first byte."""
        ...

    def completion_tokens(self) -> int:
        """Tokens generated so far (recorded once, at the end)."""
        ...

    #: True when `settle` has work to do before the bytes `feed` or `tail` just returned go out.
    unsettled: bool

    async def settle(self) -> None:
        """Asynchronous work due before the bytes just framed go out: storing what a later request
        restores when a choice ends, storing a response before its terminal (or error) event, publishing
        a background response's events. The driver awaits it only while `unsettled`."""
        ...


class NothingToSettle:
    """For framers whose choices need no asynchronous work when they end."""

    __slots__ = ()
    unsettled = False

    async def settle(self) -> None:
        return None


class RequestFramer:
    """For framers of one request whose failure after the first byte ends with the request's terminal
    frame, in its wire's shape (`RequestContext.error_frame`)."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: RequestContext) -> None:
        self._ctx = ctx

    def error(self, exc: BaseException) -> bytes:
        return self._ctx.error_frame(exc)


async def open_generation(
    state: GatewayState,
    prepared: PreparedRequest,
    ctx: RequestContext,
    *,
    stream: bool,
    pinned: Worker | None = None,
) -> AsyncIterator[EngineChunk]:
    """Dispatch `prepared` and wait for the first chunk, so failures before any output are raised here
    (real HTTP errors). Returns the whole chunk stream, first chunk included; closing it aborts the
    engine request, and the request's clean-up closes it if the body never starts. `pinned` keeps a
    later generation of one response on the worker of the earlier ones while it is available."""
    if pinned is None and not prepared.group.has_available_worker():
        raise NoHealthyWorker(f"no healthy worker serves model {prepared.group.name!r}")
    if prepared.max_reasoning_tokens is not None:
        stream = True  # the budget is enforced on the token stream, cutting the analysis as it grows
    # Both `dispatch` and the budgeted stream are async generators: closing one aborts the request.
    dispatched = dispatch(state, prepared, ctx, stream=stream, pinned=pinned)
    chunks = with_reasoning_budget(state, prepared, ctx, dispatched)
    ctx.cleanups.append(chunks.aclose)  # idempotent; aborts the engine request if nothing else did
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        return _empty()
    except BaseException:
        await chunks.aclose()
        raise
    return _Prepended(first, chunks)


async def _empty() -> AsyncIterator[EngineChunk]:
    return
    yield  # an async generator with nothing to give


class _Prepended(Generic[T]):
    """`first`, then `rest`; closing it closes `rest`. It adds no frame to the per-item path: after
    `first`, each `__anext__` is `rest`'s own awaitable (an async generator layer here would cost a
    suspension and an exception per engine message)."""

    __slots__ = ("_first", "_pending", "_rest")

    def __init__(self, first: T, rest: AsyncGenerator[T, None]) -> None:
        self._first = first
        self._pending = True
        self._rest = rest

    def __aiter__(self) -> _Prepended[T]:
        return self

    def __anext__(self) -> Awaitable[T]:
        if self._pending:
            self._pending = False
            return _ready(self._first)
        return self._rest.__anext__()

    async def aclose(self) -> None:
        self._pending = False
        await self._rest.aclose()


async def _ready(value: T) -> T:
    return value


async def drive(
    ctx: RequestContext, source: AsyncIterator[T], framer: Framer[T], head: bytes = b""
) -> AsyncGenerator[bytes, None]:
    """A streamed body: `head`, then each item's frames as they form, then the tail. A failure becomes
    the framer's error frame (after `head` was sent, the status is already 200) and sets `ctx.status`;
    the source is closed on every exit, a client leaving included."""
    async with contextlib.aclosing(source):  # type: ignore[type-var]
        try:
            out = head
            async for item in source:
                out += framer.feed(item)
                if framer.unsettled:
                    await framer.settle()
                if out:
                    yield out
                    out = b""
                if framer.stopped():
                    break  # leaving the loop closes the source, which aborts the engine request
            ctx.completion_tokens = framer.completion_tokens()
            out += framer.tail()
            if framer.unsettled:
                await framer.settle()
            yield out
        except BaseException as exc:  # a gateway bug or a dependency's panic, too, ends with the wire's error
            if not is_failure(exc):
                # The client left (or the gateway is stopping): what was generated is still counted,
                # so a stream cut on purpose is charged to its token budget.
                ctx.completion_tokens = framer.completion_tokens()
                raise
            if isinstance(exc, GatewayError):
                ctx.status = exc.status_code
            else:
                log_failure(log, f"stream of {ctx.request_id}", exc)
                ctx.status = 500
            ctx.completion_tokens = framer.completion_tokens()
            out = framer.error(exc)
            if framer.unsettled:
                await framer.settle()  # e.g. store the failed response before the client hears of it
            yield out


async def collect(source: AsyncIterator[T], framer: Framer[T]) -> None:
    """A JSON body: feed every item (stopping early when the framer says so) and close the source;
    failures propagate as HTTP errors. The body is built from the framer afterwards."""
    async with contextlib.aclosing(source):  # type: ignore[type-var]
        async for item in source:
            framer.feed(item)
            if framer.unsettled:
                await framer.settle()
            if framer.stopped():
                break


def _no_head() -> bytes:
    return b""


@dataclass(slots=True, eq=False)
class Generation(Generic[T]):
    """A surface's request, planned: how to open its source and how to frame what comes out of it.

    `open` dispatches (failures before any output raise here, as HTTP errors); `framer` turns items into
    the wire's bytes. A JSON request has a `body`, built once every item was fed; a streamed one has
    none, and sends `head()` (read after `open`) before the first item's frames. `close` releases what
    the plan holds beyond the engine streams (a response's MCP connections): on a failure to open, and
    when a stream's request ends."""

    open: Callable[[], Awaitable[AsyncIterator[T]]]
    framer: Framer[T]
    body: Callable[[], Awaitable[Any]] | None = None
    head: Callable[[], bytes] = _no_head
    close: Callable[[], Awaitable[None]] | None = None


#: What a surface's plan answers: a generation to run, or an answer ready at once (a background
#: response: its queued body, or the stream of its stored events).
Planned = Generation[Any] | dict[str, Any] | list[Any] | AsyncGenerator[bytes, None]


async def answer(ctx: RequestContext, planned: Planned) -> Any:
    """The one run of every surface: open the generation, then stream it (`drive`) or collect it into
    its JSON body; records the request's completion tokens once. Returns the body (a dict or list) or
    the SSE byte stream."""
    if not isinstance(planned, Generation):
        return planned
    try:
        source = await planned.open()
    except BaseException:
        if planned.close is not None:
            await planned.close()
        raise
    if planned.body is None:
        if planned.close is not None:
            ctx.cleanups.append(planned.close)  # also when the stream never starts (client gone early)
        return drive(ctx, source, planned.framer, planned.head())
    try:
        await collect(source, planned.framer)
    except BaseException:
        ctx.completion_tokens = planned.framer.completion_tokens()  # charged even when the body never forms
        raise
    body = await planned.body()
    ctx.completion_tokens = planned.framer.completion_tokens()
    return body


__all__ = [
    "Framer",
    "Generation",
    "NothingToSettle",
    "Planned",
    "answer",
    "collect",
    "drive",
    "open_generation",
]
