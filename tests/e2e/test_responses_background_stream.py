"""Background streaming with resume (REFERENCE §6.1): live events, the stored event log, `starting_after`
replay continuing live, another replica polling the store, and cancel ending a live stream."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.responses_stream import validate_event_stream
from tests.support.servers import (
    RunningGateway,
    client_request_id,
    client_request_ids,
    running_gateway,
    test_settings,
    wait_until,
)


def _client(gw: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0, timeout=30)


def _dump(events: list[Any]) -> list[dict[str, Any]]:
    return [e.model_dump(exclude_unset=True, warnings=False) for e in events]


@pytest.fixture(scope="module")
async def slow_sim() -> AsyncIterator[RunningSim]:
    async with await start_sim_engine(SimConfig(model=MODEL, tokens_per_second=200)) as engine:
        yield engine


@pytest.fixture(scope="module")
async def slow_gateway(slow_sim: RunningSim, tmp_path_factory) -> AsyncIterator[RunningGateway]:
    db = tmp_path_factory.mktemp("bg") / "responses.db"
    async with running_gateway(
        test_settings(worker_urls=(slow_sim.url,), storage_url=f"sqlite:///{db}")
    ) as gw:
        yield gw


async def test_background_stream_is_live_and_replayable(client: openai.AsyncOpenAI, gateway) -> None:
    stream = await client.responses.create(model=MODEL, input="Tell me a story", background=True, stream=True)
    events = _dump([e async for e in stream])
    validate_event_stream(events)
    assert events[0]["response"]["status"] == "queued"
    assert events[1]["response"]["status"] == "in_progress"
    assert events[-1]["type"] == "response.completed"
    response_id = events[0]["response"]["id"]
    stored = await client.responses.retrieve(response_id)
    assert stored.status == "completed" and stored.background
    assert stored.output_text == events[-1]["response"]["output"][-1]["content"][0]["text"]

    # The whole log, then every tail: concatenated with the head it must be the same valid stream.
    replay = _dump([e async for e in await client.responses.retrieve(response_id, stream=True)])
    assert replay == events
    for n in (0, 1, 5, len(events) - 2):
        tail = await client.responses.retrieve(response_id, stream=True, starting_after=n)
        tail_events = _dump([e async for e in tail])
        assert [e["sequence_number"] for e in tail_events] == list(range(n + 1, len(events)))
        validate_event_stream(events[: n + 1] + tail_events)

    # The SDK helper replays from the start and filters on its side; its final response is the stored one.
    async with client.responses.stream(response_id=response_id, starting_after=3) as helper:
        seen = [e.sequence_number async for e in helper]
        final = await helper.get_final_response()
    assert seen[0] == 4 and final.id == response_id and final.output_text == stored.output_text


async def test_resume_after_disconnect_continues_live(slow_gateway: RunningGateway, slow_sim) -> None:
    store = slow_gateway.state.store
    writes: list[int] = []
    append = store.append_events

    async def counting(response_id: str, events: Any) -> None:
        writes.append(len(events))
        await append(response_id, events)

    store.append_events = counting
    try:
        async with _client(slow_gateway) as c:
            stream = await c.responses.create(
                model=MODEL, input="[[long]] think first", background=True, stream=True
            )
            head = []
            async for event in stream:
                head.append(event.model_dump(exclude_unset=True, warnings=False))
                if event.type == "response.reasoning_text.delta" and len(head) > 20:
                    break
            await stream.close()  # the client leaves; the response keeps running
            response_id = head[0]["response"]["id"]
            assert (await c.responses.retrieve(response_id)).status == "in_progress"
            assert slow_gateway.state.background.running(response_id)

            last = head[-1]["sequence_number"]
            tail = await c.responses.retrieve(response_id, stream=True, starting_after=last)
            rest = _dump([e async for e in tail])
            full = head + rest
            validate_event_stream(full)
            assert rest[0]["sequence_number"] == last + 1
            assert full[-1]["type"] == "response.completed"
            assert (await c.responses.retrieve(response_id)).status == "completed"
    finally:
        del store.append_events
    # Every event is in the log, written in batches rather than one write per event.
    logged = await store.list_events(response_id)
    assert [e["sequence_number"] for e in logged] == list(range(len(full)))
    assert [e["type"] for e in logged] == [e["type"] for e in full]
    assert sum(writes) >= len(full) and len(writes) < len(full) / 4


async def test_another_replica_replays_then_polls(slow_gateway: RunningGateway, slow_sim, tmp_path) -> None:
    settings = slow_gateway.state.settings
    async with running_gateway(
        test_settings(worker_urls=(slow_sim.url,), storage_url=settings.storage_url)
    ) as other:
        async with _client(slow_gateway) as c, _client(other) as o:
            stream = await c.responses.create(
                model=MODEL, input="[[long]] from replica one", background=True, stream=True
            )
            head = []
            async for event in stream:
                head.append(event.model_dump(exclude_unset=True, warnings=False))
                if len(head) == 12:
                    break
            await stream.close()
            response_id = head[0]["response"]["id"]
            assert other.state.background.feed(response_id) is None  # not running there
            tail = await o.responses.retrieve(response_id, stream=True, starting_after=5)
            rest = _dump([e async for e in tail])
            validate_event_stream(head[:6] + rest)
            assert rest[-1]["type"] == "response.completed"


async def test_cancel_ends_the_live_stream(slow_gateway: RunningGateway, slow_sim) -> None:
    async with _client(slow_gateway) as c:
        stream = await c.responses.create(
            model=MODEL, input="[[long]] cancel me", background=True, stream=True
        )
        events: list[dict[str, Any]] = []
        cancelled = None
        async for event in stream:
            events.append(event.model_dump(exclude_unset=True, warnings=False))
            if len(events) == 10:
                cancelled = await c.responses.cancel(events[0]["response"]["id"])
        validate_event_stream(events)
        assert cancelled is not None and cancelled.status == "cancelled"
        assert events[-1]["type"] == "response.failed"
        assert events[-1]["response"]["status"] == "cancelled"
        await wait_until(lambda: any(r for r in slow_sim.aborted), timeout=5)
        # A resumed stream of the cancelled response ends the same way.
        tail = await c.responses.retrieve(cancelled.id, stream=True, starting_after=8)
        validate_event_stream(events[:9] + _dump([e async for e in tail]))


async def test_cancel_through_another_replica(slow_gateway: RunningGateway, slow_sim) -> None:
    """`serve --workers N` or several replicas: the cancel lands on a process that does not run the
    response. It is stored as cancelled there; the running process notices, aborts its engine request
    and ends the response's event log as cancelled."""
    settings = slow_gateway.state.settings
    async with running_gateway(
        test_settings(worker_urls=(slow_sim.url,), storage_url=settings.storage_url)
    ) as other:
        async with _client(slow_gateway) as c, _client(other) as o:
            quick = await c.responses.create(model=MODEL, input="hello there", background=True)
            created = await c.responses.create(
                model=MODEL, input="[[long]] cancel me elsewhere", background=True
            )
            engine_request_id = created._request_id
            assert engine_request_id
            await wait_until(
                lambda: any(client_request_id(r.request_id) == engine_request_id for r in slow_sim.requests)
            )
            assert slow_gateway.state.background.running(created.id)
            assert not other.state.background.running(created.id)

            cancelled = await o.responses.cancel(created.id)
            assert cancelled.id == created.id and cancelled.status == "cancelled"
            await wait_until(lambda: engine_request_id in client_request_ids(slow_sim.aborted), timeout=5)
            await wait_until(lambda: not slow_gateway.state.background.running(created.id), timeout=5)
            stored = await c.responses.retrieve(created.id)
            assert stored.status == "cancelled" and stored.error is None
            assert stored.output and stored.output[-1].status == "incomplete"  # what it had generated
            events = _dump([e async for e in await o.responses.retrieve(created.id, stream=True)])
            validate_event_stream(events)
            assert events[-1]["type"] == "response.failed"
            assert events[-1]["response"]["status"] == "cancelled"
            assert (await o.responses.cancel(created.id)).status == "cancelled"  # unchanged

            # A response that completed before the cancel stays completed: 400, on either replica.
            await wait_until(lambda: not slow_gateway.state.background.running(quick.id), timeout=10)
            assert (await o.responses.retrieve(quick.id)).status == "completed"
            for client in (o, c):
                with pytest.raises(openai.BadRequestError):
                    await client.responses.cancel(quick.id)
            assert (await c.responses.retrieve(quick.id)).status == "completed"


async def test_a_cancel_stored_first_wins_over_the_completion(client: openai.AsyncOpenAI, gateway) -> None:
    """A cancel that lands (on another replica) just before the task stores its completion: the
    completion must not resurrect the response, and the event log ends as the store does."""
    store = gateway.state.store
    update = store.update_response_if
    raced: list[str] = []

    async def cancel_first(record: Any, from_statuses: Any) -> bool:
        if record.status == "completed" and not raced:
            raced.append(record.id)
            cancelled = dataclasses.replace(record, status="cancelled", response=dict(record.response))
            cancelled.response.update(status="cancelled", completed_at=None)
            assert await update(cancelled, {"queued", "in_progress"})
        return await update(record, from_statuses)

    store.update_response_if = cancel_first
    try:
        r = await client.responses.create(model=MODEL, input="finish and lose", background=True)
        await wait_until(lambda: not gateway.state.background.running(r.id), timeout=10)
    finally:
        del store.update_response_if
    assert raced == [r.id]
    stored = await client.responses.retrieve(r.id)
    assert stored.status == "cancelled" and stored.output_text  # what it generated, kept
    events = _dump([e async for e in await client.responses.retrieve(r.id, stream=True)])
    validate_event_stream(events)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "cancelled"
    assert not any(e["type"] == "response.completed" for e in events)
    assert (await client.responses.cancel(r.id)).status == "cancelled"


async def test_non_background_responses_are_not_replayable(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model=MODEL, input="plain")
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.retrieve(r.id, stream=True)
    assert info.value.param == "stream"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_missing", stream=True)
    bg = await client.responses.create(model=MODEL, input="bg", background=True)
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.retrieve(bg.id, stream=True, starting_after=-5)
    assert info.value.param == "starting_after"


async def test_background_without_stream_is_logged_too(client: openai.AsyncOpenAI, gateway) -> None:
    """A background response created without `stream` can still be streamed (from its log)."""
    r = await client.responses.create(model=MODEL, input="poll me", background=True)
    for _ in range(200):
        if (await client.responses.retrieve(r.id)).status == "completed":
            break
        await asyncio.sleep(0.05)
    events = _dump([e async for e in await client.responses.retrieve(r.id, stream=True)])
    validate_event_stream(events)
    stored = await client.responses.retrieve(r.id)
    assert events[-1]["type"] == "response.completed"
    assert [item["id"] for item in events[-1]["response"]["output"]] == [item.id for item in stored.output]


@pytest.mark.parametrize("attempt", range(5))
async def test_a_client_leaving_never_cuts_a_background_stream(
    slow_gateway: RunningGateway, attempt: int
) -> None:
    """The background task has its own context, engine stream and clean-up: the HTTP response of the
    client that started it closing (the client left after a few events) must not reach the engine
    stream the task still reads. Stored, it equals a run whose client stayed to the end.

    The ordering is made explicit: the client leaves while the task is parked in an event-log write,
    between two engine chunks, and the task goes on only once the HTTP request has finished its
    clean-up: a shared engine stream would be closed under it right there."""
    state = slow_gateway.state
    store, metrics = state.store, state.metrics
    append, observe = store.append_events, metrics.observe
    armed, parked, request_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def observing(ctx: Any) -> None:
        if parked.is_set() and ctx.route == "responses":
            request_done.set()
        observe(ctx)

    async def held(response_id: str, events: Any) -> None:
        if armed.is_set() and not parked.is_set():
            parked.set()
            await asyncio.wait_for(request_done.wait(), timeout=10)
        await append(response_id, events)

    prompt = f"[[long]] keep going {attempt}"
    metrics.observe, store.append_events = observing, held
    try:
        async with _client(slow_gateway) as c:
            stayed = await c.responses.create(model=MODEL, input=prompt, background=True, stream=True)
            full = _dump([e async for e in stayed])
            assert full[-1]["type"] == "response.completed"

            stream = await c.responses.create(model=MODEL, input=prompt, background=True, stream=True)
            head = []
            async for event in stream:
                head.append(event.model_dump(exclude_unset=True, warnings=False))
                if event.type == "response.reasoning_text.delta":
                    break
            armed.set()
            await asyncio.wait_for(parked.wait(), timeout=10)
            await stream.close()  # the client leaves while the engine is still generating
            response_id = head[0]["response"]["id"]
            await wait_until(lambda: not state.background.running(response_id), timeout=20)
            assert request_done.is_set()
            left_behind = await c.responses.retrieve(response_id)
            kept = await c.responses.retrieve(full[0]["response"]["id"])
            events = _dump([e async for e in await c.responses.retrieve(response_id, stream=True)])
    finally:
        del metrics.observe, store.append_events
    assert left_behind.status == "completed" and kept.status == "completed"
    assert left_behind.output_text and left_behind.output_text == kept.output_text
    assert left_behind.usage is not None and kept.usage is not None
    assert left_behind.usage.output_tokens == kept.usage.output_tokens
    assert [item.type for item in left_behind.output] == [item.type for item in kept.output]
    validate_event_stream(events)
    assert events[-1]["type"] == "response.completed"
