"""The event log of background responses: live fan-out on this replica, batched writes to the store, and
replay for `GET /v1/responses/{id}?stream=true&starting_after=N` (REFERENCE §6.1).

A running background response owns one `EventFeed`. Its producer `publish`es each batch of events: the
batch becomes visible to live subscribers at once and is appended to the store's event log in batches
(every `FLUSH_INTERVAL` seconds, at item boundaries, or when `FLUSH_EVENTS` are pending). The terminal
event is written to the store before any subscriber sees it, so a client that saw the end can always
replay it. The feed keeps only the newest `WINDOW` events in memory; a subscriber that falls behind the
window reads the gap from the store (everything older than the window is stored), so a slow reader
never grows memory.

`stream_stored_events` serves a reader: it follows the live feed when the response runs on this replica,
else replays the stored log and polls it until the terminal event (the response runs on another
replica), with a deadline. Sequence numbers are the response's own, so replay and live continue one
another without a gap or a repeat.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from ...pipeline.context import LiveEvents, RequestContext
from ...wire import responses_error_event
from .objects import complete_event
from .output import frame

log = logging.getLogger(__name__)

TERMINAL_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
FINISHED_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})
#: Write pending events at least this often (seconds) while a response streams.
FLUSH_INTERVAL = 0.05
#: ... or as soon as this many are pending; must stay below WINDOW (pending events are always in memory).
FLUSH_EVENTS = 256
#: Newest events a feed keeps in memory for live subscribers.
WINDOW = 2048
#: Pending events kept while the store fails (older ones are dropped from the log, not from live streams).
MAX_PENDING = WINDOW // 2
#: How often a reader polls the store for a response running on another replica.
POLL_INTERVAL = 0.1
#: Polls after the stored status became final without its terminal event, before giving up.
FINAL_GRACE_POLLS = 10

Event = dict[str, Any]


class EventFeed:
    """Live events of one running background response. One producer (the response's task) publishes;
    any number of subscribers `follow`. Not thread-safe; all on the event loop."""

    def __init__(self, response_id: str, store: Any) -> None:
        self.response_id = response_id
        self._store = store
        self._recent: deque[tuple[int, bytes]] = deque(maxlen=WINDOW)
        self._pending: list[Event] = []
        self._last_flush = time.monotonic()
        self._changed = asyncio.Event()
        #: Sequence number of the terminal event once it is published (the feed is then complete).
        self.terminal_sequence: int | None = None

    async def publish(self, events: Sequence[tuple[Event, bytes]]) -> None:
        """Make `events` visible and store them in batches; a terminal event is stored first, then shown.

        Events stay pending in memory until a write succeeds, so a cancelled or failed write loses
        nothing: the next publish (at the latest the terminal one) writes them again. A failing store
        does not fail the response; its log then misses events, which a replay reports."""
        if not events:
            return
        self._pending.extend(event for event, _ in events)
        if events[-1][0]["type"] in TERMINAL_TYPES:
            await self.flush()
            self._show(events)
            self.terminal_sequence = events[-1][0]["sequence_number"]
            return
        self._show(events)
        due = time.monotonic() - self._last_flush >= FLUSH_INTERVAL or len(self._pending) >= FLUSH_EVENTS
        if due or any(event["type"] == "response.output_item.done" for event, _ in events):
            await self.flush()

    async def flush(self) -> None:
        """Append the pending events to the store's log (idempotent per sequence number)."""
        if not self._pending:
            return
        batch = list(self._pending)
        try:
            await self._store.append_events(self.response_id, batch)
        except Exception as exc:
            log.warning("could not write the event log of %s: %s", self.response_id, exc)
            if len(self._pending) > MAX_PENDING:
                del self._pending[: len(self._pending) - MAX_PENDING]  # pending must stay in the window
            return
        del self._pending[: len(batch)]
        self._last_flush = time.monotonic()

    def _show(self, events: Sequence[tuple[Event, bytes]]) -> None:
        for event, framed in events:
            self._recent.append((event["sequence_number"], framed))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self, after: int, *, idle_timeout: float) -> AsyncIterator[tuple[int, bytes]]:
        """Frames of the events with `sequence_number > after`, live, until the terminal event, each
        piece with the sequence number of its last event.

        Events that left the in-memory window are read from the store. Raises TimeoutError when no
        event arrives for `idle_timeout` seconds."""
        cursor = after
        while True:
            changed = self._changed
            first = self._recent[0][0] if self._recent else None
            if first is not None and cursor + 1 < first:
                # Fell behind the window: everything older than it is stored.
                for event in await self._store.list_events(self.response_id, after=cursor):
                    number = event["sequence_number"]
                    if number >= first:
                        break
                    cursor = number
                    yield cursor, frame(event)
                if cursor + 1 < first:
                    raise LookupError(f"events {cursor + 1}..{first - 1} of {self.response_id} are missing")
                continue
            if first is not None:
                start = max(cursor + 1 - first, 0)
                batch = list(itertools.islice(self._recent, start, None))
                if batch:
                    cursor = batch[-1][0]
                    yield cursor, b"".join(framed for _, framed in batch)
            if self.terminal_sequence is not None and cursor >= self.terminal_sequence:
                return
            async with asyncio.timeout(idle_timeout):
                await changed.wait()


async def stream_stored_events(
    store: Any,
    response_id: str,
    owner: str,
    after: int,
    feed: LiveEvents | None,
    ctx: RequestContext,
    *,
    idle_timeout: float,
) -> AsyncGenerator[bytes, None]:
    """Frames of a background response's events after `after`, then live until its terminal event,
    for the request `ctx`, whose `next_sequence` follows the events handed out.

    `feed` is the live feed when the response runs on this replica. Otherwise the stored log is read and
    polled every `POLL_INTERVAL` until it holds the terminal event. Ends with an `error` event (never an
    exception: the headers are sent) when no event arrives for `idle_timeout` seconds, or when the
    response finished without a terminal event in its log (a replica died mid-response)."""
    cursor = after
    ctx.next_sequence = after + 1
    try:
        if feed is not None:
            async for last, piece in feed.follow(after, idle_timeout=idle_timeout):
                cursor = last
                ctx.next_sequence = last + 1
                yield piece
            return
        deadline = time.monotonic() + idle_timeout
        grace = FINAL_GRACE_POLLS
        while True:
            events = await store.list_events(response_id, after=cursor)
            if events:
                deadline = time.monotonic() + idle_timeout
            for event in events:
                cursor = event["sequence_number"]
                ctx.next_sequence = cursor + 1
                yield frame(complete_event(event))  # a log written by an earlier version too
                if event["type"] in TERMINAL_TYPES:
                    return
            if not events:
                record = await store.get_response(response_id, owner)
                if record is None:
                    yield responses_error_event(
                        cursor + 1,
                        "not_found",
                        "the response was deleted",
                        error_type="invalid_request_error",
                    )
                    return
                if record.status in FINISHED_STATUSES:
                    grace -= 1
                    if grace <= 0:
                        yield responses_error_event(
                            cursor + 1,
                            "server_error",
                            f"the response ended ({record.status}) without the rest of its stream events",
                        )
                        return
            if time.monotonic() >= deadline:
                raise TimeoutError
            await asyncio.sleep(POLL_INTERVAL)
    except TimeoutError:
        yield responses_error_event(cursor + 1, "timeout", "timed out waiting for the response's next event")
    except LookupError as exc:
        yield responses_error_event(cursor + 1, "server_error", str(exc))
