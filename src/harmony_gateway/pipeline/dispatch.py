"""Stage 4, dispatch: send the engine request to the selected worker(s) and stream its chunks.

- A failure before the first chunk (connection refused, UNAVAILABLE) is retried on another worker with
  backoff, at most `max_retries` times; after a chunk has been yielded a failure is raised, never
  replayed.
- Any exit other than normal completion (client disconnect, consumer error, timeout) sends `Abort`,
  shielded and bounded, so the engine frees the request's KV cache; then the original error propagates.
- Each engine call (an attempt, a later generation of the same request) goes out under its own engine
  request id (`RequestContext.next_engine_id`), and its Abort names that id: the engine sees one live
  request per call, never one left over from the call before.
- PD: the same request goes to a prefill and a decode worker with one bootstrap room; tokens come from
  decode; a failure of either side cancels the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable

import anyio

from ..engines.base import EngineChunk, GenerateRequest
from ..errors import UpstreamError, UpstreamTimeout
from ..observability import tracing
from ..routing.health import record_failure, record_success
from ..routing.workers import Worker
from .build_request import bootstrap_for, build_generate_request
from .context import GatewayState, PreparedRequest, RequestContext
from .select_worker import select_worker

log = logging.getLogger(__name__)


async def _abort(worker: Worker, request_id: str, timeout: float) -> None:
    # Shielded: a cancelled client must still free the engine's KV cache.
    with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
        try:
            await worker.client.abort(request_id)
        except Exception as exc:  # the request is gone either way; never mask the original error
            log.debug("abort of %s on %s failed: %s", request_id, worker.public_url, exc)


def _first_then_rest(
    stream: AsyncGenerator[EngineChunk, None], first_token_timeout: float, url: str
) -> AsyncGenerator[EngineChunk, None]:
    """`stream`, its first chunk awaited within `first_token_timeout` (else UpstreamTimeout); closing it
    closes `stream`, which cancels the engine client's gRPC call then, not whenever the garbage
    collector finalises it."""
    return _FirstThenRest(stream, first_token_timeout, url)  # type: ignore[return-value]


class _FirstThenRest:
    """After the first chunk each `__anext__` is the engine stream's own awaitable: no generator layer
    of its own on the per-message path (a layer costs a suspension and an exception per message)."""

    __slots__ = ("_first_token_timeout", "_started", "_stream", "_url")

    def __init__(
        self, stream: AsyncGenerator[EngineChunk, None], first_token_timeout: float, url: str
    ) -> None:
        self._stream = stream
        self._first_token_timeout = first_token_timeout
        self._url = url
        self._started = False

    def __aiter__(self) -> _FirstThenRest:
        return self

    def __anext__(self) -> Awaitable[EngineChunk]:
        if self._started:
            return self._stream.__anext__()
        self._started = True
        return self._first()

    async def _first(self) -> EngineChunk:
        try:
            # The engine span is current while the call starts: its trace context goes in the metadata.
            with tracing.span("gateway.engine", **{"server.address": self._url}):
                async with asyncio.timeout(self._first_token_timeout):
                    return await anext(self._stream)
        except TimeoutError:
            await self._stream.aclose()
            raise UpstreamTimeout(
                f"engine at {self._url} sent no output within {self._first_token_timeout:g} s"
            ) from None
        except BaseException:
            await self._stream.aclose()
            raise

    async def aclose(self) -> None:
        self._started = True
        await self._stream.aclose()


async def _drain_prefill(worker: Worker, request: GenerateRequest) -> EngineChunk | None:
    last = None
    async for chunk in worker.client.generate(request):
        last = chunk
    return last


async def _generate_pd(
    decode: Worker, prefill: Worker, request: GenerateRequest, timeout: float
) -> AsyncGenerator[EngineChunk, None]:
    consumer = asyncio.current_task()
    prefill_task = asyncio.create_task(_drain_prefill(prefill, request))

    def _on_prefill_done(task: asyncio.Task[EngineChunk | None]) -> None:
        if not task.cancelled() and task.exception() is not None and consumer is not None:
            consumer.cancel()  # decode would wait forever for the KV transfer

    prefill_task.add_done_callback(_on_prefill_done)
    try:
        async for chunk in _first_then_rest(decode.client.generate(request), timeout, decode.public_url):
            if chunk.finished and not chunk.prompt_tokens and prefill_task.done():
                prefill_last = prefill_task.result()
                if prefill_last is not None:
                    chunk.prompt_tokens = prefill_last.prompt_tokens
                    chunk.cached_tokens = chunk.cached_tokens or prefill_last.cached_tokens
            yield chunk
    except asyncio.CancelledError:
        if prefill_task.done() and not prefill_task.cancelled() and prefill_task.exception() is not None:
            if consumer is not None:
                consumer.uncancel()
            raise prefill_task.exception() from None  # type: ignore[misc]
        raise
    finally:
        prefill_task.remove_done_callback(_on_prefill_done)
        if not prefill_task.done():
            prefill_task.cancel()


async def dispatch(
    state: GatewayState,
    prepared: PreparedRequest,
    ctx: RequestContext,
    *,
    stream: bool,
    input_ids: list[int] | None = None,
    pinned: Worker | None = None,
) -> AsyncGenerator[EngineChunk, None]:
    """Stream engine chunks for a prepared request. `pinned` keeps a tool loop on one worker while it
    stays available (its prefix cache holds the conversation)."""
    settings = state.settings
    timeouts = settings.timeouts
    metrics = state.metrics
    tuner = state.stream_tuner
    tried: list[Worker] = []
    attempt = 0
    while True:
        if pinned is not None and pinned.available() and not tried:
            worker, prefill = pinned, None
        else:
            worker, prefill = select_worker(prepared, ctx, exclude=tried)
        ctx.worker, ctx.prefill_worker = worker, prefill
        engine_id = ctx.next_engine_id()
        bootstrap = bootstrap_for(prefill, settings.bootstrap_port) if prefill is not None else None
        request = build_generate_request(
            prepared,
            ctx,
            stream=stream,
            bootstrap=bootstrap,
            input_ids=input_ids,
            stream_interval=(
                None
                if not worker.client.capabilities.stream_interval
                else tuner.interval_for(worker)
                if settings.stream_interval == 0
                else settings.stream_interval
            ),
        )
        yielded = False
        finished = False
        workers = (worker,) if prefill is None else (worker, prefill)
        for w in workers:
            w.in_flight += 1
        try:
            if prefill is None:
                chunks = _first_then_rest(
                    worker.client.generate(request), timeouts.first_token, worker.public_url
                )
            else:
                chunks = _generate_pd(worker, prefill, request, timeouts.first_token)
            # The total deadline is on the engine call itself (the gRPC deadline, httpx's read timeout);
            # here it is only checked per chunk, for an engine that trickles. A timeout scope around the
            # `yield` would cancel whatever the consumer awaits meanwhile (a socket write) and surface as
            # a bare CancelledError instead of UpstreamTimeout.
            deadline = time.monotonic() + timeouts.total
            previous = 0.0
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    now = time.monotonic()
                    if not yielded:
                        yielded = True
                        if ctx.first_token_at is None:
                            ctx.first_token_at = time.perf_counter()
                    elif now > deadline:
                        raise UpstreamTimeout(
                            f"engine at {worker.public_url} did not finish within {timeouts.total:g} s"
                        )
                    elif stream:
                        tuner.observe(worker, now - previous, len(chunk.token_ids))
                    previous = now
                    yield chunk
            finished = True
            for w in workers:
                record_success(w)
            return
        except UpstreamError as exc:
            # A request the engine refused as invalid is the client's fault: a few bad requests must
            # not open the breaker and make the model unavailable for everyone.
            if exc.blames_worker:
                for w in workers:
                    record_failure(w, state.health_config)
            if yielded or not exc.retryable or attempt >= settings.max_retries:
                raise
            attempt += 1
            ctx.retries += 1
            tried.extend(workers)
            if metrics is not None:
                metrics.retries.labels(model=prepared.group.name).inc()
            log.info("retrying %s on another worker after %s", ctx.request_id, exc.message)
            await asyncio.sleep(settings.retry_backoff * (2 ** (attempt - 1)))
        finally:
            for w in workers:
                w.in_flight -= 1
            for w in workers:
                if w.kind.value == "regular":
                    try:
                        prepared.group.policy.on_request_done(w, None)
                    except Exception:  # a policy's bookkeeping never fails the request
                        log.exception(
                            "routing policy %s failed after %s", prepared.group.policy.name, ctx.request_id
                        )
            if not finished:
                for w in workers:
                    await _abort(w, engine_id, timeouts.abort)
