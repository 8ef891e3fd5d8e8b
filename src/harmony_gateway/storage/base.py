"""Storage records and the `Store` protocol every backend (memory, SQLite, PostgreSQL) subclasses: it
checks the arguments of the contract once, and a backend implements what is left.

The pipeline persists stored Responses (with their input items and the replay history it needs to
continue a `previous_response_id` chain), a per-response event log for resuming background streams,
and Conversations with ordered items. Payloads are plain JSON-able dicts and lists; storage never
interprets them beyond the `id` of an item. Every object belongs to the owner that created it, and
any other owner is answered exactly as if the object did not exist.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypedDict, Unpack, runtime_checkable

import orjson

from .. import errors
from ..types.limits import (
    ConversationLimits,
    ConversationSize,
)

#: Every status a stored response may have (OpenAI's Response.status).
RESPONSE_STATUSES = frozenset({"queued", "in_progress", "completed", "incomplete", "failed", "cancelled"})

Order = Literal["asc", "desc"]


class PageArgs(TypedDict, total=False):
    """The keywords that pick one page of a list (`Store.list_input_items`, `list_conversation_items`).

    `after` is an item id cursor: the page starts just past it in the requested order (default: the
    first page). `limit` caps the page (default 20), `order` is by position (default "desc").
    """

    after: str | None
    limit: int
    order: Order


@dataclass(slots=True)
class RecentItems:
    """The newest items of a conversation that fit a byte budget, oldest first, and how many older
    items were left unread (`omitted`): a caller that needs the whole history sees it was cut."""

    items: list[dict[str, Any]]
    omitted: int = 0


@dataclass(slots=True)
class StoredResponse:
    """One stored Response and what the pipeline needs to continue a chain from it.

    `response` is the Response object exactly as returned to clients; `input_items` are this
    request's input items (each with an `id`); `history` is the serialized replay messages, opaque
    to storage; `request` is the request body as received, minus secrets.
    """

    id: str
    owner: str
    created_at: int
    updated_at: float
    status: str
    model: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    previous_response_id: str | None = None
    conversation_id: str | None = None
    background: bool = False
    request: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RecentChain:
    """A `previous_response_id` chain, oldest first, read within a byte budget (`Store.load_recent_chain`);
    `omitted` is True when an ancestor exists that the budget left unread."""

    responses: list[StoredResponse]
    omitted: bool = False


def replay_size(response: StoredResponse) -> int:
    """What continuing a chain reads of a response: its history, input items and Response, as stored
    JSON bytes. TypeError if they are not JSON."""
    return sum(
        len(orjson.dumps(part)) for part in (response.history, response.input_items, response.response)
    )


@dataclass(slots=True)
class StoredConversation:
    id: str
    owner: str
    created_at: int
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ConversationItem:
    """One item of a conversation; `id` is the item dict's own `id`.

    `position` increases monotonically within a conversation and is never reused, even after
    deletes, so it orders items and serves as the pagination key.
    """

    id: str
    conversation_id: str
    position: int
    item: dict[str, Any]
    created_at: int


class NewItems:
    """Items on their way into a conversation, with their ids (`item_ids`): read, and checked to be
    there, once, by `Store` before a backend stores them."""

    __slots__ = ("ids", "items")

    def __init__(self, items: Sequence[dict[str, Any]]) -> None:
        self.items = items
        self.ids = item_ids(items)


@dataclass(slots=True)
class Page:
    """One page of a list endpoint: item dicts in the requested order, OpenAI's list envelope fields."""

    data: list[dict[str, Any]]
    has_more: bool
    first_id: str | None
    last_id: str | None


@dataclass(slots=True)
class StoredWorker:
    """A worker registered through the worker API, shared by every process on the store.

    `kind` is a `routing.workers.WorkerKind` value; one (url, kind) pair is registered at most once.
    """

    id: str
    url: str
    kind: str
    engine: str
    created_at: float


@dataclass(slots=True)
class WorkerHealth:
    """One worker's health as the process holding the health lease last probed it.

    `key` names the worker by what every process agrees on, `kind:url` (see `worker_health_key`), so
    workers configured on the command line, whose ids are per process, are covered too.
    """

    key: str
    healthy: bool
    consecutive_failures: int
    consecutive_successes: int
    model_info: dict[str, Any] | None
    updated_at: float


def worker_health_key(kind: str, url: str) -> str:
    return f"{kind}:{url}"


@runtime_checkable
class Store(Protocol):
    """Persistence for Responses, background event logs and Conversations.

    Owner scoping: reads, updates and deletes take the caller's `owner`; an object created by a
    different owner yields None / False exactly as a missing one does. The startup scan
    (`list_responses_with_status`), the event log and `purge_expired` are gateway-internal and not
    owner scoped: the API layer checks the response's visibility before touching its events.

    Writes are committed when the coroutine returns: a process killed right afterwards does not
    lose them. A payload that is not JSON-serializable raises TypeError and nothing is written.
    Database errors other than the domain errors named below propagate unchanged.

    Backends subclass it. Where the contract checks arguments, the method here checks them and hands
    on to a `_`-prefixed method of the backend (at the end of the class), so every backend refuses
    the same input the same way.
    """

    async def start(self) -> None:
        """Connect and create or migrate the schema.

        Idempotent, and safe when several processes start on the same database at once. Raises
        RuntimeError if the database was written by a newer schema version than this code knows.
        """
        ...

    async def close(self) -> None:
        """Release connections; the store may not be used afterwards."""
        ...

    # -- responses ------------------------------------------------------------------------------

    async def put_response(self, response: StoredResponse) -> None:
        """Insert or replace a response by id (this is also how status updates are written).

        Raises ValueError for an unknown status or an input item without an `id`.
        """
        check_response(response)
        await self._put_response(response)

    async def update_response_if(self, response: StoredResponse, from_statuses: Collection[str]) -> bool:
        """Replace the stored response `response.id` with `response` only while its status is one of
        `from_statuses`, atomically (a conditional UPDATE on SQL backends): of two writers racing on one
        response (a cancel and a completion), the one that loses sees False and nothing is written.

        False as well when the response is missing or belongs to another owner. Raises ValueError as
        `put_response` does.
        """
        check_response(response)
        return await self._update_response_if(response, from_statuses)

    async def get_response(self, response_id: str, owner: str) -> StoredResponse | None: ...

    async def get_response_status(self, response_id: str) -> str | None:
        """The response's status, of any owner, or None when it does not exist: one small read for the
        watcher of a running background response (gateway-internal, like the event log)."""
        ...

    async def delete_response(self, response_id: str, owner: str) -> bool:
        """Delete a response and its event log; False if it is not visible to `owner`."""
        ...

    async def list_input_items(self, response_id: str, owner: str, **page: Unpack[PageArgs]) -> Page | None:
        """One page of the response's input items (`PageArgs`); None if the response is not visible.

        Raises errors.InvalidRequest (param `after`) for a cursor that is not one of the items,
        ValueError for `limit < 1` or an unknown order.
        """
        after, limit, order = page_args(page)
        items = await self._input_items(response_id, owner)
        return None if items is None else paginate(items, after=after, limit=limit, order=order)

    async def load_recent_chain(
        self, response_id: str, owner: str, *, max_bytes: int | None, max_depth: int = 100
    ) -> RecentChain:
        """The response and its ancestors by `previous_response_id`, oldest first, within a byte budget:
        the response itself always, then its ancestors newest first while their `replay_size`s (the
        response's own included) sum to at most `max_bytes` (None: no budget). Ancestors past the budget
        are not read; `omitted` says one exists. There is no unbudgeted read on purpose: what a turn
        loads is bounded by what its context can show.

        Raises errors.InvalidRequest (param `previous_response_id`, code `previous_response_not_found`)
        if `response_id` itself is missing or not visible; ValueError for `max_bytes < 0` or
        `max_depth < 1`. A missing or invisible ancestor ends the walk there, as does a cycle (the walk
        stops before repeating a response). At most `max_depth` responses are returned: the newest ones.
        """
        check_max_depth(max_depth)
        check_budget(max_bytes)
        return await self._load_recent_chain(response_id, owner, max_bytes, max_depth)

    async def list_responses_with_status(
        self, statuses: set[str], *, background_only: bool = True
    ) -> list[StoredResponse]:
        """Every response in one of `statuses`, of any owner, oldest first (start-up recovery)."""
        ...

    # -- background event log -------------------------------------------------------------------

    async def append_events(self, response_id: str, events: Sequence[dict[str, Any]]) -> None:
        """Append stream events; each must carry an int `sequence_number` (ValueError otherwise).

        An event whose sequence number is already stored for the response is ignored, so a retried
        append is harmless.
        """
        numbers = sequence_numbers(events)
        if events:
            await self._append_events(response_id, numbers, events)

    async def list_events(self, response_id: str, *, after: int = -1) -> list[dict[str, Any]]:
        """Stored events with `sequence_number > after`, ordered by sequence number."""
        ...

    # -- conversations --------------------------------------------------------------------------

    async def create_conversation(
        self,
        conversation: StoredConversation,
        items: Sequence[dict[str, Any]],
        *,
        limits: ConversationLimits | None = None,
    ) -> list[ConversationItem]:
        """Create a conversation with its initial items, atomically.

        Raises ValueError for an item without an `id`, errors.Conflict if the conversation id
        exists or item ids repeat, errors.InvalidRequest if the items pass `limits`.
        """
        new = NewItems(items)
        check_new_item_ids(new.ids, set())
        return await self._create_conversation(conversation, new, limits)

    async def get_conversation(self, conversation_id: str, owner: str) -> StoredConversation | None: ...

    async def update_conversation_metadata(
        self, conversation_id: str, owner: str, metadata: dict[str, Any]
    ) -> StoredConversation | None:
        """Replace the conversation's metadata; the updated conversation, or None if not visible."""
        ...

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        """Delete a conversation and all its items; False if it is not visible."""
        ...

    async def add_conversation_items(
        self,
        conversation_id: str,
        owner: str,
        items: Sequence[dict[str, Any]],
        *,
        limits: ConversationLimits | None = None,
    ) -> list[ConversationItem] | None:
        """Append items in order after the existing ones; None if the conversation is not visible.

        Safe under concurrent appends from several processes: positions stay unique and each call's
        items are contiguous, and `limits` (None: unlimited) is checked against what the conversation
        holds at the moment of the append, so racing appenders never pass it together. Raises
        ValueError for an item without an `id` (the API layer assigns ids), errors.Conflict for an
        id already in the conversation and errors.InvalidRequest (`ConversationLimits.check`) past a
        limit; nothing is written then.
        """
        return await self._add_conversation_items(conversation_id, owner, NewItems(items), limits)

    async def count_conversation_items(self, conversation_id: str, owner: str) -> int | None:
        """How many items the conversation holds; None if it is not visible."""
        ...

    async def conversation_size(self, conversation_id: str, owner: str) -> ConversationSize | None:
        """How many items the conversation holds and their stored bytes; None if it is not visible."""
        ...

    async def recent_conversation_items(
        self, conversation_id: str, owner: str, *, max_bytes: int | None
    ) -> RecentItems | None:
        """The newest items whose stored sizes sum to at most `max_bytes` (None: every item), in
        position order; None if the conversation is not visible.

        Older items are not read at all (only their sizes are): loading a history costs the budget,
        not the conversation. The walk stops at the first item that does not fit, so the result is
        always a contiguous tail of the conversation. Raises ValueError for `max_bytes < 0`.
        """
        check_budget(max_bytes)
        return await self._recent_conversation_items(conversation_id, owner, max_bytes)

    async def list_conversation_items(
        self, conversation_id: str, owner: str, **page: Unpack[PageArgs]
    ) -> Page | None:
        """One page of item dicts by position (`PageArgs`); raises as `list_input_items` does."""
        return await self._list_conversation_items(conversation_id, owner, *page_args(page))

    async def get_conversation_item(
        self, conversation_id: str, item_id: str, owner: str
    ) -> ConversationItem | None: ...

    async def delete_conversation_item(self, conversation_id: str, item_id: str, owner: str) -> bool: ...

    async def all_conversation_items(self, conversation_id: str, owner: str) -> list[dict[str, Any]] | None:
        """Every item dict in position order; None if not visible. Prompts load
        `recent_conversation_items` instead, which reads no more than the context can show."""
        ...

    # -- gateway values -------------------------------------------------------------------------
    # Small JSON values the gateway shares between its processes and replicas (the reasoning key, the
    # analysis behind tool calls it issued), each optionally expiring at a wall-clock time.

    async def put_value(self, key: str, value: dict[str, Any], *, expires_at: float | None = None) -> None:
        """Set `key` to `value` (replacing any earlier value)."""
        ...

    async def get_value(self, key: str, *, now: float) -> dict[str, Any] | None:
        """The value of `key`; None when absent or expired at `now`."""
        ...

    async def add_value(self, key: str, value: dict[str, Any]) -> dict[str, Any]:
        """Set `key` to `value` unless it has a value already; returns the value that is stored. Atomic
        across processes: concurrent callers all get the first writer's value."""
        ...

    # -- retention ------------------------------------------------------------------------------

    async def purge_expired(self, now: float) -> int:
        """Delete responses (and their events) created more than `retention_seconds` before `now`.

        Returns how many responses were deleted; always 0 when the store has no retention.
        Conversations are not subject to retention. Expired gateway values are deleted too.
        """
        ...

    # -- shared worker registry (serve --workers N) -----------------------------------------------

    async def add_worker(self, worker: StoredWorker) -> None:
        """Register a worker. Raises errors.Conflict when its id or its (url, kind) is taken."""
        ...

    async def delete_worker(self, worker_id: str) -> StoredWorker | None:
        """Remove a registered worker and its health row; the removed worker, or None if unknown."""
        ...

    async def list_workers(self) -> list[StoredWorker]:
        """Every registered worker, oldest first."""
        ...

    async def put_worker_health(self, health: Sequence[WorkerHealth]) -> None:
        """Insert or replace health rows by key."""
        ...

    async def list_worker_health(self) -> list[WorkerHealth]: ...

    async def acquire_lease(self, name: str, owner: str, ttl: float, now: float) -> bool:
        """Take or renew the lease `name` until `now + ttl`, atomically: True when `owner` holds it
        afterwards (it was free, expired, or already `owner`'s), False while another owner holds it."""
        ...

    async def release_lease(self, name: str, owner: str) -> None:
        """Give the lease up if `owner` holds it, so another process need not wait for expiry."""
        ...

    # -- implemented by each backend, called once the arguments are checked ----------------------

    async def _put_response(self, response: StoredResponse) -> None: ...

    async def _update_response_if(self, response: StoredResponse, from_statuses: Collection[str]) -> bool: ...

    async def _input_items(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        """The response's input items, for the caller to keep (a copy, if the backend holds the
        originals); None if it is not visible."""
        ...

    async def _load_recent_chain(
        self, response_id: str, owner: str, max_bytes: int | None, max_depth: int
    ) -> RecentChain: ...

    async def _append_events(
        self, response_id: str, numbers: list[int], events: Sequence[dict[str, Any]]
    ) -> None:
        """Append `events` (at least one), whose sequence numbers are `numbers`."""
        ...

    async def _create_conversation(
        self, conversation: StoredConversation, new: NewItems, limits: ConversationLimits | None
    ) -> list[ConversationItem]:
        """Create the conversation with the items `new`, whose ids differ from each other."""
        ...

    async def _add_conversation_items(
        self, conversation_id: str, owner: str, new: NewItems, limits: ConversationLimits | None
    ) -> list[ConversationItem] | None: ...

    async def _recent_conversation_items(
        self, conversation_id: str, owner: str, max_bytes: int | None
    ) -> RecentItems | None: ...

    async def _list_conversation_items(
        self, conversation_id: str, owner: str, after: str | None, limit: int, order: Order
    ) -> Page | None: ...


def check_response(response: StoredResponse) -> None:
    """ValueError for a response that cannot be stored: an unknown status or an input item without an `id`."""
    if response.status not in RESPONSE_STATUSES:
        raise ValueError(f"unknown response status {response.status!r}")
    item_ids(response.input_items)


def item_ids(items: Sequence[dict[str, Any]]) -> list[str]:
    """The `id` of each item; ValueError if one lacks a non-empty string id."""
    ids: list[str] = []
    for index, item in enumerate(items):
        item_id = item.get("id") if isinstance(item, dict) else None
        if not isinstance(item_id, str) or not item_id:
            raise ValueError(f"item {index} has no 'id'; ids are assigned before storing")
        ids.append(item_id)
    return ids


def check_new_item_ids(ids: Sequence[str], existing: set[str]) -> None:
    """Raise errors.Conflict if an id repeats within `ids` or is already in `existing`."""
    seen = set(existing)
    for item_id in ids:
        if item_id in seen:
            raise errors.Conflict(f"Item '{item_id}' is already in the conversation.", param="items")
        seen.add(item_id)


def item_sizes(items: Sequence[dict[str, Any]]) -> list[int]:
    """Each item's stored size: its JSON (orjson, UTF-8) in bytes. TypeError if one is not JSON."""
    return [len(orjson.dumps(item)) for item in items]


def size_of(sizes: Sequence[int]) -> ConversationSize:
    return ConversationSize(len(sizes), sum(sizes))


def check_budget(max_bytes: int | None) -> None:
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be at least 0, got {max_bytes}")


def newest_within(sizes_newest_first: Iterable[int], max_bytes: int | None) -> int:
    """How many of the newest items fit `max_bytes` (see `Store.recent_conversation_items`)."""
    check_budget(max_bytes)
    kept = total = 0
    for size in sizes_newest_first:
        total += size
        if max_bytes is not None and total > max_bytes:
            break
        kept += 1
    return kept


def within_budget(sizes_newest_first: Sequence[int], max_bytes: int | None) -> int:
    """How many responses of a walked chain `Store.load_recent_chain` keeps: the newest always."""
    return min(len(sizes_newest_first), max(1, newest_within(sizes_newest_first, max_bytes)))


def page_args(page: PageArgs) -> tuple[str | None, int, Order]:
    """`page`'s (after, limit, order), defaults filled in. ValueError for `limit < 1` or an unknown
    order, TypeError for a keyword that is none of them (as a plain signature would raise)."""
    unknown = page.keys() - PageArgs.__optional_keys__
    if unknown:
        raise TypeError(f"unexpected page keyword {', '.join(sorted(unknown))}")
    limit, order = page.get("limit", 20), page.get("order", "desc")
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
    return page.get("after"), limit, order


def check_max_depth(max_depth: int) -> None:
    if max_depth < 1:
        raise ValueError(f"max_depth must be at least 1, got {max_depth}")


def unknown_cursor(after: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(f"No item with id '{after}' to list after.", param="after")


def paginate(items: Sequence[dict[str, Any]], *, after: str | None, limit: int, order: Order) -> Page:
    """Cut one page out of the full, ascending list of item dicts (see `Store.list_input_items`)."""
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        for index, item in enumerate(ordered):
            if item.get("id") == after:
                start = index + 1
                break
        else:
            raise unknown_cursor(after)
    return make_page(ordered[start : start + limit + 1], limit)


def make_page(rows: list[dict[str, Any]], limit: int) -> Page:
    """A Page from up to `limit + 1` ordered items; the extra one only signals `has_more`."""
    data = rows[:limit]
    return Page(
        data=data,
        has_more=len(rows) > limit,
        first_id=data[0]["id"] if data else None,
        last_id=data[-1]["id"] if data else None,
    )


def previous_response_not_found(response_id: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def sequence_numbers(events: Sequence[dict[str, Any]]) -> list[int]:
    """Each event's `sequence_number`; ValueError if one is missing or not an int."""
    numbers = []
    for event in events:
        number = event.get("sequence_number")
        if not isinstance(number, int) or isinstance(number, bool):
            raise ValueError("every event needs an int 'sequence_number'")
        numbers.append(number)
    return numbers
