"""In-process `Store` for tests and single-process deployments that may forget everything on restart.

Bounded: beyond `max_responses` responses (or `max_conversations` conversations) the oldest are
evicted with their events (items), so a long-running gateway never grows without limit. Payloads
are copied through JSON on the way in and out, so callers never share mutable state with the store
and anything the SQL backends would reject is rejected here too.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

import harmony_gateway.storage.base as base

from .. import errors
from ..types.limits import ConversationLimits, ConversationSize

DEFAULT_MAX_RESPONSES = 10_000
DEFAULT_MAX_CONVERSATIONS = 10_000
DEFAULT_MAX_VALUES = 100_000


def _copy(value: Any) -> Any:
    return orjson.loads(orjson.dumps(value))


def _copy_items(items: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """Copies of the items and their stored sizes (`base.item_sizes`), from one serialisation each.

    One item at a time: orjson's output keeps the buffer it reserved (about fifteen times the JSON for
    long strings) until it is freed, so a list of them would hold that for every item at once."""
    copies, sizes = [], []
    for item in items:
        raw = orjson.dumps(item)
        copies.append(orjson.loads(raw))
        sizes.append(len(raw))
    return copies, sizes


def _copy_response(response: base.StoredResponse) -> base.StoredResponse:
    return replace(
        response,
        response=_copy(response.response),
        input_items=_copy(response.input_items),
        history=_copy(response.history),
        request=_copy(response.request),
        metadata=_copy(response.metadata),
    )


@dataclass(slots=True)
class _Conversation:
    record: base.StoredConversation
    items: list[base.ConversationItem] = field(default_factory=list)
    #: Each item's stored size, by item id.
    sizes: dict[str, int] = field(default_factory=dict)
    next_position: int = 0

    def size(self) -> ConversationSize:
        return ConversationSize(len(self.items), sum(self.sizes.values()))


class MemoryStore(base.Store):
    """A `Store` held in dicts; see the module docstring for bounds.

    No method awaits while it mutates state, so every call is atomic with respect to other tasks
    on the loop without a lock.
    """

    def __init__(
        self,
        *,
        retention_seconds: float | None = None,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
    ) -> None:
        if max_responses < 1 or max_conversations < 1:
            raise ValueError("max_responses and max_conversations must be at least 1")
        self.retention_seconds = retention_seconds
        self.max_responses = max_responses
        self.max_conversations = max_conversations
        # Insertion order is creation order, so the first entry is the one to evict.
        self._responses: OrderedDict[str, base.StoredResponse] = OrderedDict()
        self._events: dict[str, dict[int, dict[str, Any]]] = {}
        #: Each stored response's `replay_size`, by id.
        self._replay_sizes: dict[str, int] = {}
        self._conversations: OrderedDict[str, _Conversation] = OrderedDict()
        #: Gateway values, oldest first; bounded like responses (the oldest is evicted first).
        self._values: OrderedDict[str, tuple[dict[str, Any], float | None]] = OrderedDict()
        self.max_values = DEFAULT_MAX_VALUES
        self._workers: dict[str, base.StoredWorker] = {}
        self._worker_health: dict[str, base.WorkerHealth] = {}
        self._leases: dict[str, tuple[str, float]] = {}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    # -- responses ------------------------------------------------------------------------------

    async def _put_response(self, response: base.StoredResponse) -> None:
        size = base.replay_size(response)
        self._responses[response.id] = _copy_response(response)
        self._replay_sizes[response.id] = size
        while len(self._responses) > self.max_responses:
            evicted, _ = self._responses.popitem(last=False)
            self._events.pop(evicted, None)
            self._replay_sizes.pop(evicted, None)

    async def _update_response_if(
        self, response: base.StoredResponse, from_statuses: Collection[str]
    ) -> bool:
        stored = self._visible(response.id, response.owner)
        if stored is None or stored.status not in from_statuses:
            return False
        size = base.replay_size(response)
        # Replaced in place: the response keeps its position in the eviction order.
        self._responses[response.id] = _copy_response(response)
        self._replay_sizes[response.id] = size
        return True

    async def get_response_status(self, response_id: str) -> str | None:
        stored = self._responses.get(response_id)
        return stored.status if stored is not None else None

    def _visible(self, response_id: str, owner: str) -> base.StoredResponse | None:
        stored = self._responses.get(response_id)
        return stored if stored is not None and stored.owner == owner else None

    async def get_response(self, response_id: str, owner: str) -> base.StoredResponse | None:
        stored = self._visible(response_id, owner)
        return _copy_response(stored) if stored is not None else None

    async def delete_response(self, response_id: str, owner: str) -> bool:
        if self._visible(response_id, owner) is None:
            return False
        del self._responses[response_id]
        self._events.pop(response_id, None)
        self._replay_sizes.pop(response_id, None)
        return True

    async def _input_items(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        stored = self._visible(response_id, owner)
        return _copy(stored.input_items) if stored is not None else None

    async def _load_recent_chain(
        self, response_id: str, owner: str, max_bytes: int | None, max_depth: int
    ) -> base.RecentChain:
        if self._visible(response_id, owner) is None:
            raise base.previous_response_not_found(response_id)
        walked: list[base.StoredResponse] = []
        seen: set[str] = set()
        current: str | None = response_id
        while current is not None and current not in seen and len(walked) < max_depth:
            stored = self._visible(current, owner)
            if stored is None:
                break
            seen.add(current)
            walked.append(stored)
            current = stored.previous_response_id
        kept = base.within_budget([self._replay_sizes[r.id] for r in walked], max_bytes)
        chain = [_copy_response(r) for r in reversed(walked[:kept])]
        return base.RecentChain(chain, omitted=kept < len(walked))

    async def list_responses_with_status(
        self, statuses: set[str], *, background_only: bool = True
    ) -> list[base.StoredResponse]:
        found = [
            _copy_response(r)
            for r in self._responses.values()
            if r.status in statuses and (r.background or not background_only)
        ]
        found.sort(key=lambda r: (r.created_at, r.id))
        return found

    # -- background event log -------------------------------------------------------------------

    async def _append_events(
        self, response_id: str, numbers: list[int], events: Sequence[dict[str, Any]]
    ) -> None:
        log = self._events.setdefault(response_id, {})
        for number, event in zip(numbers, events, strict=True):
            log.setdefault(number, _copy(event))

    async def list_events(self, response_id: str, *, after: int = -1) -> list[dict[str, Any]]:
        log = self._events.get(response_id, {})
        return [_copy(log[n]) for n in sorted(log) if n > after]

    # -- conversations --------------------------------------------------------------------------

    def _conversation(self, conversation_id: str, owner: str) -> _Conversation | None:
        conversation = self._conversations.get(conversation_id)
        return conversation if conversation is not None and conversation.record.owner == owner else None

    async def _create_conversation(
        self, conversation: base.StoredConversation, new: base.NewItems, limits: ConversationLimits | None
    ) -> list[base.ConversationItem]:
        if conversation.id in self._conversations:
            raise errors.Conflict(f"Conversation '{conversation.id}' already exists.")
        # Copy (and so validate) everything before the first change: a failed call changes nothing.
        record = replace(conversation, metadata=_copy(conversation.metadata))
        copies, sizes = _copy_items(new.items)
        if limits is not None:
            limits.check(ConversationSize(), base.size_of(sizes))
        entry = _Conversation(record=record)
        self._conversations[conversation.id] = entry
        while len(self._conversations) > self.max_conversations:
            self._conversations.popitem(last=False)
        return self._append(entry, new.ids, copies, sizes)

    def _append(
        self, entry: _Conversation, ids: list[str], copies: list[dict[str, Any]], sizes: list[int]
    ) -> list[base.ConversationItem]:
        now = int(time.time())
        added = []
        for item_id, item, size in zip(ids, copies, sizes, strict=True):
            added.append(base.ConversationItem(item_id, entry.record.id, entry.next_position, item, now))
            entry.sizes[item_id] = size
            entry.next_position += 1
        entry.items.extend(added)
        return [replace(a, item=_copy(a.item)) for a in added]

    async def get_conversation(self, conversation_id: str, owner: str) -> base.StoredConversation | None:
        entry = self._conversation(conversation_id, owner)
        return replace(entry.record, metadata=_copy(entry.record.metadata)) if entry else None

    async def update_conversation_metadata(
        self, conversation_id: str, owner: str, metadata: dict[str, Any]
    ) -> base.StoredConversation | None:
        entry = self._conversation(conversation_id, owner)
        if entry is None:
            return None
        entry.record = replace(entry.record, metadata=_copy(metadata))
        return replace(entry.record, metadata=_copy(entry.record.metadata))

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        if self._conversation(conversation_id, owner) is None:
            return False
        del self._conversations[conversation_id]
        return True

    async def _add_conversation_items(
        self, conversation_id: str, owner: str, new: base.NewItems, limits: ConversationLimits | None
    ) -> list[base.ConversationItem] | None:
        entry = self._conversation(conversation_id, owner)
        if entry is None:
            return None
        base.check_new_item_ids(new.ids, set(entry.sizes))
        copies, sizes = _copy_items(new.items)
        if limits is not None:
            limits.check(entry.size(), base.size_of(sizes))
        return self._append(entry, new.ids, copies, sizes)

    async def count_conversation_items(self, conversation_id: str, owner: str) -> int | None:
        entry = self._conversation(conversation_id, owner)
        return len(entry.items) if entry is not None else None

    async def conversation_size(self, conversation_id: str, owner: str) -> ConversationSize | None:
        entry = self._conversation(conversation_id, owner)
        return entry.size() if entry is not None else None

    async def _recent_conversation_items(
        self, conversation_id: str, owner: str, max_bytes: int | None
    ) -> base.RecentItems | None:
        entry = self._conversation(conversation_id, owner)
        if entry is None:
            return None
        kept = base.newest_within((entry.sizes[i.id] for i in reversed(entry.items)), max_bytes)
        tail = entry.items[len(entry.items) - kept :]
        return base.RecentItems([_copy(i.item) for i in tail], omitted=len(entry.items) - kept)

    async def _list_conversation_items(
        self, conversation_id: str, owner: str, after: str | None, limit: int, order: base.Order
    ) -> base.Page | None:
        entry = self._conversation(conversation_id, owner)
        if entry is None:
            return None
        ordered = entry.items if order == "asc" else list(reversed(entry.items))
        start = 0
        if after is not None:
            for index, item in enumerate(ordered):
                if item.id == after:
                    start = index + 1
                    break
            else:
                raise base.unknown_cursor(after)
        return base.make_page([_copy(i.item) for i in ordered[start : start + limit + 1]], limit)

    async def get_conversation_item(
        self, conversation_id: str, item_id: str, owner: str
    ) -> base.ConversationItem | None:
        entry = self._conversation(conversation_id, owner)
        if entry is None:
            return None
        for item in entry.items:
            if item.id == item_id:
                return replace(item, item=_copy(item.item))
        return None

    async def delete_conversation_item(self, conversation_id: str, item_id: str, owner: str) -> bool:
        entry = self._conversation(conversation_id, owner)
        if entry is None:
            return False
        if entry.sizes.pop(item_id, None) is None:
            return False
        entry.items = [i for i in entry.items if i.id != item_id]
        return True

    async def all_conversation_items(self, conversation_id: str, owner: str) -> list[dict[str, Any]] | None:
        entry = self._conversation(conversation_id, owner)
        return [_copy(i.item) for i in entry.items] if entry is not None else None

    # -- gateway values -------------------------------------------------------------------------

    async def put_value(self, key: str, value: dict[str, Any], *, expires_at: float | None = None) -> None:
        self._values.pop(key, None)
        self._values[key] = (_copy(value), expires_at)
        while len(self._values) > self.max_values:
            self._values.popitem(last=False)

    async def get_value(self, key: str, *, now: float) -> dict[str, Any] | None:
        entry = self._values.get(key)
        if entry is None or (entry[1] is not None and entry[1] <= now):
            return None
        return _copy(entry[0])  # type: ignore[no-any-return]

    async def add_value(self, key: str, value: dict[str, Any]) -> dict[str, Any]:
        entry = self._values.get(key)
        if entry is not None and (entry[1] is None or entry[1] > time.time()):
            return _copy(entry[0])  # type: ignore[no-any-return]
        await self.put_value(key, value)
        return _copy(value)  # type: ignore[no-any-return]

    # -- retention ------------------------------------------------------------------------------

    async def purge_expired(self, now: float) -> int:
        for key in [k for k, (_, exp) in self._values.items() if exp is not None and exp <= now]:
            del self._values[key]
        if self.retention_seconds is None:
            return 0
        cutoff = now - self.retention_seconds
        expired = [rid for rid, r in self._responses.items() if r.created_at < cutoff]
        for response_id in expired:
            del self._responses[response_id]
            self._events.pop(response_id, None)
            self._replay_sizes.pop(response_id, None)
        return len(expired)

    # -- shared worker registry -----------------------------------------------------------------
    # One process only (memory:// is refused for serve --workers N), but the contract is the same.

    async def add_worker(self, worker: base.StoredWorker) -> None:
        for existing in self._workers.values():
            if existing.id == worker.id or (existing.url, existing.kind) == (worker.url, worker.kind):
                raise errors.Conflict(
                    f"worker {worker.url} ({worker.kind}) is already registered", param="url"
                )
        self._workers[worker.id] = replace(worker)

    async def delete_worker(self, worker_id: str) -> base.StoredWorker | None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._worker_health.pop(base.worker_health_key(worker.kind, worker.url), None)
        return worker

    async def list_workers(self) -> list[base.StoredWorker]:
        return sorted((replace(w) for w in self._workers.values()), key=lambda w: (w.created_at, w.id))

    async def put_worker_health(self, health: Sequence[base.WorkerHealth]) -> None:
        for row in health:
            self._worker_health[row.key] = replace(row, model_info=_copy(row.model_info))

    async def list_worker_health(self) -> list[base.WorkerHealth]:
        return [replace(h, model_info=_copy(h.model_info)) for h in self._worker_health.values()]

    async def acquire_lease(self, name: str, owner: str, ttl: float, now: float) -> bool:
        held = self._leases.get(name)
        if held is not None and held[0] != owner and held[1] > now:
            return False
        self._leases[name] = (owner, now + ttl)
        return True

    async def release_lease(self, name: str, owner: str) -> None:
        held = self._leases.get(name)
        if held is not None and held[0] == owner:
            del self._leases[name]
