"""The `Store` contract, run against every backend (memory, SQLite, PostgreSQL)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

import orjson
import pytest

from harmony_gateway import errors
from harmony_gateway.storage import (
    ConversationItem,
    ConversationLimits,
    ConversationSize,
    RecentChain,
    RecentItems,
    Store,
    StoredConversation,
    StoredResponse,
)
from harmony_gateway.storage.base import replay_size

from .conftest import Backend

ALICE = "owner-alice"
BOB = "owner-bob"


async def load_chain(
    store: Store, response_id: str, owner: str, *, max_depth: int = 100
) -> list[StoredResponse]:
    """The whole chain: `load_recent_chain` without a byte budget."""
    return (await store.load_recent_chain(response_id, owner, max_bytes=None, max_depth=max_depth)).responses


def rid(prefix: str = "resp") -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response(
    response_id: str | None = None, *, owner: str = ALICE, status: str = "completed", **fields: Any
) -> StoredResponse:
    response_id = response_id or rid()
    defaults: dict[str, Any] = {
        "created_at": int(time.time()),
        "updated_at": time.time(),
        "model": "gpt-oss-20b",
        "response": {"id": response_id, "object": "response", "status": status, "output": []},
        "input_items": [{"id": rid("msg"), "type": "message", "role": "user", "content": "hi"}],
        "history": [{"role": "user", "content": "hi"}],
        "request": {"model": "gpt-oss-20b", "input": "hi"},
        "metadata": {"k": "v"},
    }
    defaults.update(fields)
    return StoredResponse(id=response_id, owner=owner, status=status, **defaults)


def items(n: int, prefix: str = "msg") -> list[dict[str, Any]]:
    return [{"id": rid(prefix), "type": "message", "role": "user", "content": f"#{i}"} for i in range(n)]


def conversation(owner: str = ALICE, **metadata: str) -> StoredConversation:
    return StoredConversation(id=rid("conv"), owner=owner, created_at=int(time.time()), metadata=metadata)


def ids(page_data: list[dict[str, Any]]) -> list[str]:
    return [item["id"] for item in page_data]


async def test_implements_protocol(store: Store) -> None:
    assert isinstance(store, Store)


# -- responses -----------------------------------------------------------------------------------


async def test_put_get_replace_delete(store: Store) -> None:
    original = response(
        status="in_progress",
        previous_response_id=None,
        conversation_id="conv_x",
        background=True,
        metadata={"nested": {"a": [1, 2.5, None, True]}, "unicode": "żółw ✓"},
    )
    await store.put_response(original)
    assert await store.get_response(original.id, ALICE) == original

    finished = response(original.id, status="completed", background=True, conversation_id="conv_x")
    finished.response["output"] = [{"id": "msg_1", "type": "message"}]
    await store.put_response(finished)
    assert await store.get_response(original.id, ALICE) == finished

    assert await store.delete_response(original.id, ALICE) is True
    assert await store.get_response(original.id, ALICE) is None
    assert await store.delete_response(original.id, ALICE) is False


async def test_returned_records_are_not_shared_with_the_store(store: Store) -> None:
    stored = response()
    await store.put_response(stored)
    stored.response["status"] = "mutated by caller"
    fetched = await store.get_response(stored.id, ALICE)
    assert fetched is not None and fetched.response["status"] == "completed"
    fetched.input_items.clear()
    again = await store.get_response(stored.id, ALICE)
    assert again is not None and len(again.input_items) == 1


async def test_put_response_validates(store: Store) -> None:
    with pytest.raises(ValueError, match="status"):
        await store.put_response(response(status="done"))
    with pytest.raises(ValueError, match="id"):
        await store.put_response(response(input_items=[{"type": "message"}]))


async def test_payloads_must_be_json(store: Store) -> None:
    bad = response(metadata={"when": time})
    with pytest.raises(TypeError):
        await store.put_response(bad)
    assert await store.get_response(bad.id, ALICE) is None
    conv = conversation()
    with pytest.raises(TypeError):
        await store.create_conversation(conv, [{"id": "msg_1", "blob": object()}])
    assert await store.get_conversation(conv.id, ALICE) is None


async def test_update_response_if_writes_only_from_the_given_statuses(store: Store) -> None:
    running = response(status="in_progress", background=True)
    await store.put_response(running)
    assert await store.get_response_status(running.id) == "in_progress"

    cancelled = response(running.id, status="cancelled", background=True)
    assert await store.update_response_if(cancelled, {"queued", "in_progress"}) is True
    assert await store.get_response(running.id, ALICE) == cancelled
    assert await store.get_response_status(running.id) == "cancelled"

    # The completion that lost the race must not resurrect the cancelled response.
    completed = response(running.id, status="completed", background=True)
    assert await store.update_response_if(completed, {"queued", "in_progress"}) is False
    assert await store.get_response(running.id, ALICE) == cancelled
    # Nor may a cancel turn a completed response into a cancelled one.
    done = response(status="completed", background=True)
    await store.put_response(done)
    assert await store.update_response_if(response(done.id, status="cancelled"), {"in_progress"}) is False
    assert await store.get_response_status(done.id) == "completed"


async def test_update_response_if_is_owner_scoped_and_validates(store: Store) -> None:
    mine = response(status="queued")
    await store.put_response(mine)
    foreign = response(mine.id, owner=BOB, status="cancelled")
    assert await store.update_response_if(foreign, {"queued"}) is False
    assert await store.update_response_if(response(rid(), status="cancelled"), {"queued"}) is False
    assert await store.update_response_if(response(mine.id, status="failed"), set()) is False
    assert await store.get_response_status(mine.id) == "queued"
    assert await store.get_response_status(rid()) is None
    with pytest.raises(ValueError, match="status"):
        await store.update_response_if(response(mine.id, status="done"), {"queued"})


async def test_update_response_if_lets_exactly_one_racer_win(store: Store) -> None:
    running = response(status="in_progress", background=True)
    await store.put_response(running)
    racers = [response(running.id, status=s, background=True) for s in ("cancelled", "completed") * 4]
    won = await asyncio.gather(*(store.update_response_if(r, {"in_progress"}) for r in racers))
    assert sum(won) == 1
    winner = racers[won.index(True)]
    assert await store.get_response(running.id, ALICE) == winner


async def test_owner_isolation_for_responses(store: Store) -> None:
    stored = response(owner=ALICE)
    await store.put_response(stored)
    await store.append_events(stored.id, [{"type": "response.created", "sequence_number": 0}])

    assert await store.get_response(stored.id, BOB) is None
    assert await store.list_input_items(stored.id, BOB) is None
    assert await store.delete_response(stored.id, BOB) is False
    with pytest.raises(errors.InvalidRequest):
        await load_chain(store, stored.id, BOB)
    # The owner still has everything, events included.
    assert await store.get_response(stored.id, ALICE) == stored
    assert len(await store.list_events(stored.id)) == 1


async def test_empty_owner_is_an_owner_like_any_other(store: Store) -> None:
    stored = response(owner="")
    await store.put_response(stored)
    assert await store.get_response(stored.id, "") == stored
    assert await store.get_response(stored.id, ALICE) is None


async def test_input_items_pagination(store: Store) -> None:
    inputs = items(5)
    all_ids = ids(inputs)
    stored = response(input_items=inputs)
    await store.put_response(stored)

    page = await store.list_input_items(stored.id, ALICE, limit=2, order="asc")
    assert page is not None
    assert ids(page.data) == all_ids[:2]
    assert (page.has_more, page.first_id, page.last_id) == (True, all_ids[0], all_ids[1])

    page = await store.list_input_items(stored.id, ALICE, after=all_ids[1], limit=2, order="asc")
    assert page is not None and ids(page.data) == all_ids[2:4] and page.has_more

    page = await store.list_input_items(stored.id, ALICE, after=all_ids[3], limit=2, order="asc")
    assert page is not None and ids(page.data) == all_ids[4:] and not page.has_more

    page = await store.list_input_items(stored.id, ALICE, limit=3, order="desc")
    assert page is not None and ids(page.data) == all_ids[::-1][:3] and page.has_more

    page = await store.list_input_items(stored.id, ALICE, after=all_ids[2], limit=10, order="desc")
    assert page is not None and ids(page.data) == [all_ids[1], all_ids[0]] and not page.has_more

    # Defaults follow OpenAI: newest first, 20 per page.
    page = await store.list_input_items(stored.id, ALICE)
    assert page is not None and ids(page.data) == all_ids[::-1] and not page.has_more
    assert page.data == inputs[::-1]

    page = await store.list_input_items(stored.id, ALICE, limit=5, order="asc")
    assert page is not None and not page.has_more  # exactly `limit` items is not "more"

    with pytest.raises(errors.InvalidRequest) as excinfo:
        await store.list_input_items(stored.id, ALICE, after="msg_unknown")
    assert excinfo.value.param == "after"
    with pytest.raises(ValueError):
        await store.list_input_items(stored.id, ALICE, limit=0)
    with pytest.raises(ValueError):
        await store.list_input_items(stored.id, ALICE, order="sideways")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="limt"):
        await store.list_input_items(stored.id, ALICE, limt=2)  # type: ignore[call-arg]


async def test_input_items_of_a_response_without_inputs(store: Store) -> None:
    stored = response(input_items=[])
    await store.put_response(stored)
    page = await store.list_input_items(stored.id, ALICE)
    assert page is not None
    assert (page.data, page.has_more, page.first_id, page.last_id) == ([], False, None, None)


# -- chains --------------------------------------------------------------------------------------


async def test_load_chain_oldest_first(store: Store) -> None:
    first = response()
    second = response(previous_response_id=first.id)
    third = response(previous_response_id=second.id)
    for r in (first, second, third):
        await store.put_response(r)
    chain = await load_chain(store, third.id, ALICE)
    assert [r.id for r in chain] == [first.id, second.id, third.id]
    assert chain[0] == first
    assert [r.id for r in await load_chain(store, first.id, ALICE)] == [first.id]


async def test_load_chain_missing_head(store: Store) -> None:
    with pytest.raises(errors.InvalidRequest) as excinfo:
        await load_chain(store, "resp_missing", ALICE)
    assert excinfo.value.param == "previous_response_id"
    assert excinfo.value.code == "previous_response_not_found"
    assert excinfo.value.status_code == 400


async def test_load_chain_stops_at_a_missing_or_foreign_ancestor(store: Store) -> None:
    orphan = response(previous_response_id="resp_deleted_long_ago")
    await store.put_response(orphan)
    assert [r.id for r in await load_chain(store, orphan.id, ALICE)] == [orphan.id]

    foreign = response(owner=BOB)
    mine = response(previous_response_id=foreign.id)
    await store.put_response(foreign)
    await store.put_response(mine)
    assert [r.id for r in await load_chain(store, mine.id, ALICE)] == [mine.id]


async def test_load_chain_cycle(store: Store) -> None:
    a, b, c = rid(), rid(), rid()
    # a -> c -> b -> a: only possible through a replaced row, but the walk must still end.
    await store.put_response(response(a, previous_response_id=c))
    await store.put_response(response(b, previous_response_id=a))
    await store.put_response(response(c, previous_response_id=b))
    chain = await load_chain(store, c, ALICE)
    assert [r.id for r in chain] == [a, b, c]

    self_loop = rid()
    await store.put_response(response(self_loop, previous_response_id=self_loop))
    assert [r.id for r in await load_chain(store, self_loop, ALICE)] == [self_loop]


async def test_load_chain_max_depth_keeps_the_newest(store: Store) -> None:
    previous: str | None = None
    chain_ids = []
    for _ in range(6):
        r = response(previous_response_id=previous)
        await store.put_response(r)
        chain_ids.append(r.id)
        previous = r.id
    chain = await load_chain(store, chain_ids[-1], ALICE, max_depth=4)
    assert [r.id for r in chain] == chain_ids[-4:]
    assert [r.id for r in await load_chain(store, chain_ids[-1], ALICE, max_depth=1)] == chain_ids[-1:]
    with pytest.raises(ValueError):
        await load_chain(store, chain_ids[-1], ALICE, max_depth=0)


async def test_load_recent_chain_reads_the_newest_within_the_budget(store: Store) -> None:
    chain: list[StoredResponse] = []
    previous: str | None = None
    for n in range(5):
        r = response(
            previous_response_id=previous, history=[{"role": "user", "content": "x" * 1000 * (n + 1)}]
        )
        await store.put_response(r)
        chain.append(r)
        previous = r.id
    sizes = [replay_size(r) for r in chain]
    head = chain[-1].id

    everything = await store.load_recent_chain(head, ALICE, max_bytes=None)
    assert everything == RecentChain(chain, omitted=False)
    assert await store.load_recent_chain(head, ALICE, max_bytes=sum(sizes)) == RecentChain(chain, False)
    newest_two = sum(sizes[-2:])
    assert await store.load_recent_chain(head, ALICE, max_bytes=newest_two) == RecentChain(chain[-2:], True)
    assert await store.load_recent_chain(head, ALICE, max_bytes=newest_two - 1) == RecentChain(
        chain[-1:], True
    )
    # The response named is read whatever its size: it is what the request continues from.
    assert await store.load_recent_chain(head, ALICE, max_bytes=0) == RecentChain(chain[-1:], True)
    assert await store.load_recent_chain(chain[0].id, ALICE, max_bytes=0) == RecentChain(chain[:1], False)
    # The depth bound still applies, and is not reported as a budget cut.
    assert await store.load_recent_chain(head, ALICE, max_bytes=None, max_depth=2) == RecentChain(
        chain[-2:], False
    )

    # A replaced response is weighed by what it holds now.
    bigger = dataclasses.replace(chain[-1], history=[{"role": "user", "content": "y" * 50_000}])
    await store.put_response(bigger)
    assert await store.load_recent_chain(head, ALICE, max_bytes=50_000 + sizes[-2]) == RecentChain(
        [bigger], True
    )

    with pytest.raises(errors.InvalidRequest):
        await store.load_recent_chain(head, BOB, max_bytes=None)
    with pytest.raises(ValueError):
        await store.load_recent_chain(head, ALICE, max_bytes=-1)


async def test_list_responses_with_status(store: Store) -> None:
    queued = response(status="queued", background=True, created_at=100)
    running = response(status="in_progress", background=True, created_at=50, owner=BOB)
    foreground = response(status="in_progress", background=False, created_at=10)
    done = response(status="completed", background=True)
    for r in (queued, running, foreground, done):
        await store.put_response(r)

    found = await store.list_responses_with_status({"queued", "in_progress"})
    assert [r.id for r in found] == [running.id, queued.id]
    found = await store.list_responses_with_status({"in_progress"}, background_only=False)
    assert [r.id for r in found] == [foreground.id, running.id]
    assert await store.list_responses_with_status(set()) == []


# -- event log -----------------------------------------------------------------------------------


async def test_events_append_and_list_after(store: Store) -> None:
    response_id = rid()
    events = [{"type": f"e{n}", "sequence_number": n, "payload": {"n": n}} for n in range(6)]
    await store.append_events(response_id, events[:2])
    await store.append_events(response_id, [])
    await store.append_events(response_id, events[4:])  # out of order: listing still sorts
    await store.append_events(response_id, events[2:4])
    assert await store.list_events(response_id) == events
    assert await store.list_events(response_id, after=3) == events[4:]
    assert await store.list_events(response_id, after=5) == []
    assert await store.list_events(rid()) == []

    # A retried append does not duplicate or overwrite.
    await store.append_events(response_id, [{"type": "retry", "sequence_number": 1}])
    assert await store.list_events(response_id) == events

    with pytest.raises(ValueError):
        await store.append_events(response_id, [{"type": "no number"}])


async def test_delete_response_drops_its_events(store: Store) -> None:
    stored = response()
    await store.put_response(stored)
    await store.append_events(stored.id, [{"type": "x", "sequence_number": 0}])
    assert await store.delete_response(stored.id, ALICE)
    assert await store.list_events(stored.id) == []


# -- conversations -------------------------------------------------------------------------------


async def test_conversation_crud(store: Store) -> None:
    conv = conversation(topic="cats")
    initial = items(2)
    created = await store.create_conversation(conv, initial)
    assert [c.id for c in created] == ids(initial)
    assert [c.position for c in created] == [0, 1]
    assert all(c.conversation_id == conv.id and c.item == i for c, i in zip(created, initial, strict=True))

    assert await store.get_conversation(conv.id, ALICE) == conv
    updated = await store.update_conversation_metadata(conv.id, ALICE, {"topic": "dogs"})
    assert updated is not None and updated.metadata == {"topic": "dogs"}
    assert updated.created_at == conv.created_at
    assert await store.get_conversation(conv.id, ALICE) == updated

    with pytest.raises(errors.Conflict):
        await store.create_conversation(conv, [])

    assert await store.delete_conversation(conv.id, ALICE) is True
    assert await store.get_conversation(conv.id, ALICE) is None
    assert await store.all_conversation_items(conv.id, ALICE) is None
    assert await store.get_conversation_item(conv.id, initial[0]["id"], ALICE) is None
    assert await store.delete_conversation(conv.id, ALICE) is False
    assert await store.update_conversation_metadata(conv.id, ALICE, {}) is None
    assert await store.add_conversation_items(conv.id, ALICE, items(1)) is None


async def test_deleted_conversation_id_can_be_created_again_empty(store: Store) -> None:
    conv = conversation()
    await store.create_conversation(conv, items(3))
    await store.delete_conversation(conv.id, ALICE)
    await store.create_conversation(conv, [])
    assert await store.all_conversation_items(conv.id, ALICE) == []


async def test_owner_isolation_for_conversations(store: Store) -> None:
    conv = conversation(owner=ALICE, topic="private")
    initial = items(2)
    await store.create_conversation(conv, initial)
    item_id = initial[0]["id"]

    assert await store.get_conversation(conv.id, BOB) is None
    assert await store.update_conversation_metadata(conv.id, BOB, {"topic": "stolen"}) is None
    assert await store.add_conversation_items(conv.id, BOB, items(1)) is None
    assert await store.list_conversation_items(conv.id, BOB) is None
    assert await store.get_conversation_item(conv.id, item_id, BOB) is None
    assert await store.all_conversation_items(conv.id, BOB) is None
    assert await store.delete_conversation_item(conv.id, item_id, BOB) is False
    assert await store.delete_conversation(conv.id, BOB) is False

    assert await store.get_conversation(conv.id, ALICE) == conv
    assert await store.all_conversation_items(conv.id, ALICE) == initial


async def test_items_keep_order_across_appends(store: Store) -> None:
    conv = conversation()
    batches = [items(2), items(3), items(1)]
    await store.create_conversation(conv, batches[0])
    positions: list[int] = []
    for batch in batches[1:]:
        added = await store.add_conversation_items(conv.id, ALICE, batch)
        assert added is not None and [a.id for a in added] == ids(batch)
        positions += [a.position for a in added]
    assert positions == [2, 3, 4, 5]
    assert await store.add_conversation_items(conv.id, ALICE, []) == []
    expected = [item for batch in batches for item in batch]
    assert await store.all_conversation_items(conv.id, ALICE) == expected

    fetched = await store.get_conversation_item(conv.id, expected[3]["id"], ALICE)
    assert isinstance(fetched, ConversationItem)
    assert (fetched.position, fetched.item, fetched.conversation_id) == (3, expected[3], conv.id)
    assert fetched.created_at >= conv.created_at - 1


async def test_conversation_item_pagination(store: Store) -> None:
    conv = conversation()
    await store.create_conversation(conv, items(3))
    await store.add_conversation_items(conv.id, ALICE, items(4))
    all_items = await store.all_conversation_items(conv.id, ALICE)
    assert all_items is not None
    all_ids = ids(all_items)

    page = await store.list_conversation_items(conv.id, ALICE, limit=3, order="asc")
    assert page is not None
    assert ids(page.data) == all_ids[:3]
    assert (page.has_more, page.first_id, page.last_id) == (True, all_ids[0], all_ids[2])
    page = await store.list_conversation_items(conv.id, ALICE, after=page.last_id, limit=3, order="asc")
    assert page is not None and ids(page.data) == all_ids[3:6] and page.has_more
    page = await store.list_conversation_items(conv.id, ALICE, after=page.last_id, limit=3, order="asc")
    assert page is not None and ids(page.data) == all_ids[6:] and not page.has_more

    page = await store.list_conversation_items(conv.id, ALICE, limit=4)
    assert page is not None and ids(page.data) == all_ids[::-1][:4] and page.has_more
    page = await store.list_conversation_items(conv.id, ALICE, after=all_ids[1], order="desc")
    assert page is not None and ids(page.data) == [all_ids[0]] and not page.has_more
    assert page.data[0] == all_items[0]

    with pytest.raises(errors.InvalidRequest) as excinfo:
        await store.list_conversation_items(conv.id, ALICE, after="msg_unknown")
    assert excinfo.value.param == "after"
    with pytest.raises(ValueError):
        await store.list_conversation_items(conv.id, ALICE, limit=0)

    empty = conversation()
    await store.create_conversation(empty, [])
    page = await store.list_conversation_items(empty.id, ALICE)
    assert page is not None
    assert (page.data, page.has_more, page.first_id, page.last_id) == ([], False, None, None)


async def test_delete_conversation_item(store: Store) -> None:
    conv = conversation()
    initial = items(3)
    await store.create_conversation(conv, initial)
    assert await store.delete_conversation_item(conv.id, initial[2]["id"], ALICE) is True
    assert await store.delete_conversation_item(conv.id, initial[2]["id"], ALICE) is False
    assert await store.delete_conversation_item(rid("conv"), initial[0]["id"], ALICE) is False
    assert await store.get_conversation_item(conv.id, initial[2]["id"], ALICE) is None
    assert await store.all_conversation_items(conv.id, ALICE) == initial[:2]

    # Positions are never reused, so a deleted tail does not hand its position to a new item.
    added = await store.add_conversation_items(conv.id, ALICE, items(1))
    assert added is not None and added[0].position == 3


async def test_count_conversation_items(store: Store) -> None:
    conv = conversation()
    initial = items(3)
    await store.create_conversation(conv, initial)
    assert await store.count_conversation_items(conv.id, ALICE) == 3
    await store.delete_conversation_item(conv.id, initial[0]["id"], ALICE)
    await store.add_conversation_items(conv.id, ALICE, items(2))
    assert await store.count_conversation_items(conv.id, ALICE) == 4
    assert await store.count_conversation_items(conv.id, BOB) is None  # another owner's: not visible
    assert await store.count_conversation_items(rid("conv"), ALICE) is None


async def test_item_ids_are_required_and_unique(store: Store) -> None:
    conv = conversation()
    with pytest.raises(ValueError):
        await store.create_conversation(conv, [{"type": "message", "role": "user", "content": "x"}])
    assert await store.get_conversation(conv.id, ALICE) is None

    initial = items(2)
    await store.create_conversation(conv, initial)
    with pytest.raises(ValueError):
        await store.add_conversation_items(conv.id, ALICE, [*items(1), {"type": "message"}])
    with pytest.raises(errors.Conflict):
        await store.add_conversation_items(conv.id, ALICE, [*items(1), initial[0]])
    twice = items(1)
    with pytest.raises(errors.Conflict):
        await store.add_conversation_items(conv.id, ALICE, twice + twice)
    with pytest.raises(errors.Conflict):
        await store.create_conversation(conversation(), twice + twice)
    # Rejected writes leave nothing behind.
    assert await store.all_conversation_items(conv.id, ALICE) == initial


async def test_concurrent_appends_keep_positions_unique_and_ordered(store: Store) -> None:
    conv = conversation()
    await store.create_conversation(conv, items(1))
    batches = [items(2, prefix=f"b{n}") for n in range(20)]
    results = await asyncio.gather(*(store.add_conversation_items(conv.id, ALICE, b) for b in batches))

    positions = [a.position for added in results if added is not None for a in added]
    assert sorted(positions) == list(range(1, 41))
    for added in results:
        assert added is not None
        assert added[1].position == added[0].position + 1  # each call's items stay contiguous
    stored = await store.all_conversation_items(conv.id, ALICE)
    assert stored is not None and len(stored) == 41
    by_position = sorted((a.position, a.id) for added in results if added is not None for a in added)
    assert ids(stored[1:]) == [item_id for _, item_id in by_position]


def sized(n: int, size: int, prefix: str = "msg") -> list[dict[str, Any]]:
    """`n` items whose stored JSON is exactly `size` bytes each."""
    out = []
    for _ in range(n):
        item: dict[str, Any] = {"id": rid(prefix), "type": "message", "role": "user", "content": ""}
        item["content"] = "x" * (size - len(orjson.dumps(item)))
        assert len(orjson.dumps(item)) == size
        out.append(item)
    return out


async def test_conversation_size_counts_items_and_json_bytes(store: Store) -> None:
    conv = conversation()
    initial = sized(3, 100)
    await store.create_conversation(conv, initial)
    assert await store.conversation_size(conv.id, ALICE) == ConversationSize(3, 300)
    await store.add_conversation_items(conv.id, ALICE, sized(1, 250))
    await store.delete_conversation_item(conv.id, initial[0]["id"], ALICE)
    assert await store.conversation_size(conv.id, ALICE) == ConversationSize(3, 450)
    assert await store.conversation_size(conv.id, BOB) is None
    assert await store.conversation_size(rid("conv"), ALICE) is None


async def test_limits_refuse_an_append_past_them_and_write_nothing(store: Store) -> None:
    limits = ConversationLimits(max_items=4, max_bytes=2000)
    conv = conversation()
    with pytest.raises(errors.InvalidRequest) as excinfo:
        await store.create_conversation(conv, sized(5, 100), limits=limits)  # five items
    assert (excinfo.value.param, excinfo.value.code) == ("items", "conversation_too_large")
    assert await store.get_conversation(conv.id, ALICE) is None

    await store.create_conversation(conv, sized(2, 300), limits=limits)
    with pytest.raises(errors.InvalidRequest) as excinfo:
        await store.add_conversation_items(conv.id, ALICE, sized(2, 701), limits=limits)  # 2002 bytes
    assert excinfo.value.code == "conversation_too_large"
    assert await store.conversation_size(conv.id, ALICE) == ConversationSize(2, 600)
    assert await store.add_conversation_items(conv.id, ALICE, sized(1, 700), limits=limits) is not None
    with pytest.raises(errors.InvalidRequest):
        await store.add_conversation_items(conv.id, ALICE, sized(2, 100), limits=limits)  # five items
    assert await store.add_conversation_items(conv.id, ALICE, sized(1, 100), limits=limits) is not None
    assert await store.add_conversation_items(conv.id, ALICE, [], limits=limits) == []
    assert await store.conversation_size(conv.id, ALICE) == ConversationSize(4, 1400)
    # Without limits the store appends as before (the gateway always passes its own).
    assert await store.add_conversation_items(conv.id, ALICE, sized(1, 100)) is not None
    # Deleting makes room again.
    held = await store.all_conversation_items(conv.id, ALICE)
    assert held is not None
    for item in held[:3]:
        await store.delete_conversation_item(conv.id, item["id"], ALICE)
    assert await store.add_conversation_items(conv.id, ALICE, sized(1, 300), limits=limits) is not None
    assert await store.conversation_size(conv.id, ALICE) == ConversationSize(3, 500)


async def test_concurrent_appends_never_pass_the_limits_together(store: Store) -> None:
    limits = ConversationLimits(max_items=100, max_bytes=1000)
    conv = conversation()
    await store.create_conversation(conv, [], limits=limits)

    async def append(batch: list[dict[str, Any]]) -> bool:
        try:
            await store.add_conversation_items(conv.id, ALICE, batch, limits=limits)
        except errors.InvalidRequest:
            return False
        return True

    accepted = await asyncio.gather(*(append(sized(1, 100)) for _ in range(25)))
    assert sum(accepted) == 10
    assert await store.conversation_size(conv.id, ALICE) == ConversationSize(10, 1000)


async def test_recent_items_read_the_newest_within_the_budget(store: Store) -> None:
    conv = conversation()
    held = sized(5, 100)
    await store.create_conversation(conv, held[:2])
    await store.add_conversation_items(conv.id, ALICE, held[2:])

    assert await store.recent_conversation_items(conv.id, ALICE, max_bytes=None) == RecentItems(held, 0)
    assert await store.recent_conversation_items(conv.id, ALICE, max_bytes=500) == RecentItems(held, 0)
    assert await store.recent_conversation_items(conv.id, ALICE, max_bytes=499) == RecentItems(held[1:], 1)
    assert await store.recent_conversation_items(conv.id, ALICE, max_bytes=200) == RecentItems(held[3:], 3)
    assert await store.recent_conversation_items(conv.id, ALICE, max_bytes=99) == RecentItems([], 5)
    # A contiguous tail: a large item stops the walk even if older, smaller ones would fit.
    await store.add_conversation_items(conv.id, ALICE, sized(1, 1000))
    newest = await store.recent_conversation_items(conv.id, ALICE, max_bytes=1050)
    assert newest is not None and len(newest.items) == 1 and newest.omitted == 5
    await store.delete_conversation_item(conv.id, held[4]["id"], ALICE)
    recent = await store.recent_conversation_items(conv.id, ALICE, max_bytes=1200)
    assert recent is not None and ids(recent.items)[:2] == ids(held[2:4]) and recent.omitted == 2

    assert await store.recent_conversation_items(conv.id, BOB, max_bytes=None) is None
    assert await store.recent_conversation_items(rid("conv"), ALICE, max_bytes=None) is None
    with pytest.raises(ValueError):
        await store.recent_conversation_items(conv.id, ALICE, max_bytes=-1)


# -- retention -----------------------------------------------------------------------------------


async def test_purge_expired(backend: Backend) -> None:
    store = await backend.open(retention_seconds=3600)
    now = 1_000_000.0
    old = response(created_at=int(now) - 7200)
    fresh = response(created_at=int(now) - 60)
    for r in (old, fresh):
        await store.put_response(r)
        await store.append_events(r.id, [{"type": "x", "sequence_number": 0}])
    conv = conversation()
    conv.created_at = int(now) - 10 * 86400
    await store.create_conversation(conv, items(1))

    assert await store.purge_expired(now) == 1
    assert await store.get_response(old.id, ALICE) is None
    assert await store.list_events(old.id) == []
    assert await store.get_response(fresh.id, ALICE) == fresh
    assert len(await store.list_events(fresh.id)) == 1
    assert await store.get_conversation(conv.id, ALICE) == conv
    assert await store.purge_expired(now) == 0


async def test_purge_without_retention_keeps_everything(store: Store) -> None:
    old = response(created_at=0)
    await store.put_response(old)
    assert await store.purge_expired(time.time()) == 0
    assert await store.get_response(old.id, ALICE) == old


# -- lifecycle and sharing -----------------------------------------------------------------------


async def test_start_is_idempotent(store: Store) -> None:
    stored = response()
    await store.put_response(stored)
    await store.start()
    assert await store.get_response(stored.id, ALICE) == stored


async def test_two_stores_on_one_database(sql_backend: Backend) -> None:
    first, second = sql_backend.store(), sql_backend.store()
    # Both start at once on a database that has no tables yet.
    await asyncio.gather(first.start(), second.start())

    stored = response()
    await first.put_response(stored)
    assert await second.get_response(stored.id, ALICE) == stored

    conv = conversation()
    await first.create_conversation(conv, [])
    batches = [items(3) for _ in range(10)]
    await asyncio.gather(
        *(
            (first if n % 2 else second).add_conversation_items(conv.id, ALICE, batch)
            for n, batch in enumerate(batches)
        )
    )
    stored_items = await second.all_conversation_items(conv.id, ALICE)
    assert stored_items is not None and len(stored_items) == 30
    page = await first.list_conversation_items(conv.id, ALICE, limit=100, order="asc")
    assert page is not None and ids(page.data) == ids(stored_items)
    # Appends from either store stay contiguous per call.
    positions = {item_id: n for n, item_id in enumerate(ids(stored_items))}
    for batch in batches:
        first_position = positions[batch[0]["id"]]
        assert [positions[i["id"]] for i in batch] == [first_position, first_position + 1, first_position + 2]


# -- gateway values ----------------------------------------------------------------------------


async def test_values_put_get_expire_and_purge(store: Store) -> None:
    key = rid("value")
    now = time.time()
    assert await store.get_value(key, now=now) is None
    await store.put_value(key, {"text": "a"}, expires_at=now + 60)
    assert await store.get_value(key, now=now) == {"text": "a"}
    assert await store.get_value(key, now=now + 61) is None  # expired
    await store.put_value(key, {"text": "b"})  # replaced, no expiry
    assert await store.get_value(key, now=now + 10_000) == {"text": "b"}
    short = rid("value")
    await store.put_value(short, {"x": 1}, expires_at=now - 1)
    await store.purge_expired(now)
    assert await store.get_value(short, now=now - 10) is None  # deleted, not merely hidden
    assert await store.get_value(key, now=now) == {"text": "b"}


async def test_add_value_keeps_the_first_writer(store: Store) -> None:
    key = rid("secret")
    results = await asyncio.gather(*(store.add_value(key, {"n": i}) for i in range(5)))
    assert len({r["n"] for r in results}) == 1
    assert await store.get_value(key, now=time.time()) == results[0]


async def test_a_version_2_database_gets_item_sizes(sql_backend: Backend) -> None:
    store = await sql_backend.open()
    conv = conversation()
    await store.create_conversation(conv, sized(3, 150))
    first = response()
    second = response(previous_response_id=first.id)
    for r in (first, second):
        await store.put_response(r)
    # Make it look like a database written before items had sizes (schema version 2).
    qualified = f'"{sql_backend.schema}".' if sql_backend.schema else ""
    engine = store._engine  # type: ignore[attr-defined]
    async with engine.begin() as conn:
        await conn.exec_driver_sql(f"DROP INDEX {qualified}ix_conversation_items_size")
        await conn.exec_driver_sql(f"ALTER TABLE {qualified}conversation_items DROP COLUMN size")
        await conn.exec_driver_sql(f"ALTER TABLE {qualified}responses DROP COLUMN replay_size")
        await conn.exec_driver_sql(f"DELETE FROM {qualified}schema_version WHERE version = 3")
    await store.close()

    upgraded = await sql_backend.open()
    assert await upgraded.conversation_size(conv.id, ALICE) == ConversationSize(3, 450)
    recent = await upgraded.recent_conversation_items(conv.id, ALICE, max_bytes=300)
    assert recent is not None and len(recent.items) == 2 and recent.omitted == 1
    both = replay_size(first) + replay_size(second)
    assert await upgraded.load_recent_chain(second.id, ALICE, max_bytes=both) == RecentChain([first, second])
    assert await upgraded.load_recent_chain(second.id, ALICE, max_bytes=both - 1) == RecentChain(
        [second], True
    )
