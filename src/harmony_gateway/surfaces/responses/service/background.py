"""Background responses: stored as queued, run by their own task (tracked by `runner.BackgroundRunner`),
their events published to the response's event log as they form, cancellable from any replica."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import anyio

from ....errors import GatewayError, InvalidRequest, NotFound, is_failure
from ....observability.logging import log_failure
from ....pipeline.context import GatewayState, RequestContext, detached_context, run_cleanups
from ....pipeline.drive import collect
from ..events import EventFeed, stream_stored_events
from ..framer import ACTIVE_STATUSES, RUNNER_KEY, ResponsesFramer, finish_response, persist, record_of
from ..objects import complete_response, ended_response
from ..output import ResponseBuilder
from ..plan import ResponsePlan
from .turns import CLOSE_TIMEOUT, begin, turns

log = logging.getLogger(__name__)


async def start_background(
    state: GatewayState, plan: ResponsePlan, ctx: RequestContext
) -> dict[str, Any] | AsyncGenerator[bytes, None]:
    """Store the response as queued, start its task and return at once: the queued Response, or with
    `stream` the live events (the caller is one more subscriber; leaving does not stop the task)."""
    builder = ResponseBuilder(plan.envelope, stream=False, record=True)
    builder.seal_reasoning = plan.seal_reasoning  # hook: encrypted reasoning items
    feed = EventFeed(plan.response_id, state.store)
    queued = builder.snapshot("queued")
    builder.announce_created("queued")
    await persist_status(state, plan, queued)
    await feed.publish(builder.take_events())
    await feed.flush()  # the log exists as soon as the response does
    # Its own context: the HTTP request's clean-up (the client leaving) must never close the engine
    # stream or tool connections this task still uses.
    task_ctx = detached_context(ctx)
    state.background.start(
        plan.response_id, _run_background(state, plan, task_ctx, builder, feed), feed, state.store
    )
    if plan.request.stream:
        return stream_stored_events(
            state.store,
            plan.response_id,
            plan.owner,
            -1,
            feed,
            ctx,
            idle_timeout=state.settings.timeouts.first_token,
        )
    return queued


#: A cancelled response may still be rewritten by its own task (with the output generated so far).
_CANCELLABLE = ACTIVE_STATUSES | {"cancelled"}


async def persist_status(
    state: GatewayState,
    plan: ResponsePlan,
    body: dict[str, Any],
    *,
    from_statuses: frozenset[str] | None = None,
) -> bool:
    """Store the background response's state; with `from_statuses`, only while its stored status is one
    of them (`Store.update_response_if`): False when another writer moved it on first."""
    record = record_of(plan, body, background=True)
    record.metadata[RUNNER_KEY] = state.background.runner_id
    if from_statuses is None:
        await state.store.put_response(record)
        return True
    return await state.store.update_response_if(record, from_statuses)


async def _run_background(
    state: GatewayState, plan: ResponsePlan, ctx: RequestContext, builder: ResponseBuilder, feed: EventFeed
) -> None:
    """The response's task: every event goes to `feed` (live subscribers and the stored log); the final
    state is stored before the terminal event is published, on every path, cancellation included."""
    try:
        if not await persist_status(
            state, plan, builder.snapshot("in_progress"), from_statuses=frozenset({"queued"})
        ):
            await plan.close_tools()
            await _end_cancelled(state, plan, builder, feed)  # cancelled while queued
            return
        builder.announce_in_progress()
        await feed.publish(builder.take_events())
        try:
            await begin(state, plan, builder, ctx)
        except BaseException:
            await plan.close_tools()
            raise
        # The turns close the tools when they end; each batch of events is published as it forms.
        framer = ResponsesFramer(state, plan, builder, ctx, publish=feed.publish)
        await collect(turns(state, plan, ctx, builder), framer)
        body = finish_response(state, plan, builder, ctx)
        if not await persist(state, plan, body, background=True):
            # A cancel was stored first: it stands, and the log ends as the store does.
            await _end_cancelled(state, plan, builder, feed)
            return
        await feed.publish(builder.take_events())
    except asyncio.CancelledError:
        # Cancelled: POST /cancel (here, or through the watcher when it reached another replica) or
        # shutdown. If the response already ended and that was stored, its own end stands.
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
            await _end_cancelled(state, plan, builder, feed)
        raise
    except BaseException as exc:
        # Any failure, a dependency's panic included, ends the response `failed`, stored, with its
        # terminal event; only KeyboardInterrupt and SystemExit pass through as they are.
        if not is_failure(exc):
            raise
        final = builder.final
        if final is None:
            message = exc.message if isinstance(exc, GatewayError) else "internal error while generating"
            if not isinstance(exc, GatewayError):
                log_failure(log, f"background response {plan.response_id}", exc)
            builder.usage = plan.usage()
            final = builder.finish("failed", error={"code": "server_error", "message": message})
        else:
            log_failure(log, f"storing background response {plan.response_id}", exc)
        stored = False
        with contextlib.suppress(Exception):
            stored = await persist_status(state, plan, final, from_statuses=ACTIVE_STATUSES)
        if not stored:
            await _end_cancelled(state, plan, builder, feed)  # the stored cancel, if any, stands
            return
        await feed.publish(builder.take_events())
    finally:
        await run_cleanups(ctx)  # this task's own engine streams
        if state.metrics is not None:
            state.metrics.observe_harmony(plan.parsers)
            # Its request was recorded when it was queued, before any token: the tokens count here.
            usage = plan.usage()
            state.metrics.observe_tokens(
                ctx.principal, plan.prepared.group.name, usage["input_tokens"], usage["output_tokens"]
            )


async def _end_cancelled(
    state: GatewayState, plan: ResponsePlan, builder: ResponseBuilder, feed: EventFeed
) -> None:
    """End a background response as cancelled: store it with the output generated so far (unless an
    ending was stored first, which then stands) and publish the matching terminal event."""
    if builder.final is not None and builder.final["status"] != "cancelled":
        with contextlib.suppress(Exception):
            if await state.store.get_response_status(plan.response_id) == "cancelled":
                builder.retract_final()  # that ending lost the race to the stored cancel
    if builder.final is None:
        builder.usage = plan.usage()
    final = builder.final or builder.finish("cancelled")
    if final["status"] == "cancelled":
        try:
            await persist_status(state, plan, final, from_statuses=_CANCELLABLE)
        except Exception as exc:
            log.warning("cancelled response %s could not be stored: %s", plan.response_id, exc)
    await feed.publish(builder.take_events())


async def cancel_response(state: GatewayState, response_id: str, owner: str) -> dict[str, Any]:
    """Cancel a background response wherever it runs (REFERENCE §6.1).

    The stored response becomes `cancelled` through a conditional write, so a response whose ending was
    stored first is not touched (400, as for any finished response) and its task's later ending cannot
    undo the cancel. The task stops at once when it runs in this process; elsewhere its watcher
    (`background.watch_for_cancel`) reads the status within a poll interval. Either way the engine
    request is aborted, and the task then stores the cancelled Response with what it had generated.
    Returns the cancelled Response."""
    record = await state.store.get_response(response_id, owner)
    if record is None:
        raise NotFound(f"Response with id {response_id!r} not found", param="response_id")
    if not record.background:
        raise InvalidRequest("Cannot cancel a synchronous response.", param="response_id")
    if record.status in ACTIVE_STATUSES:
        record.status = "cancelled"
        record.updated_at = time.time()
        record.response = ended_response(record.response, "cancelled")
        if await state.store.update_response_if(record, ACTIVE_STATUSES):
            if await state.background.cancel(response_id):
                stopped = await state.store.get_response(response_id, owner)
                return complete_response(stopped.response) if stopped is not None else record.response
            return record.response
        found = await state.store.get_response(response_id, owner)  # it ended (or was cancelled) first
        if found is None:
            raise NotFound(f"Response with id {response_id!r} not found", param="response_id")
        record = found
    if record.status == "cancelled":
        return complete_response(record.response)
    raise InvalidRequest(f"Cannot cancel a response with status {record.status!r}.", param="response_id")


__all__ = ["cancel_response", "persist_status", "start_background"]
