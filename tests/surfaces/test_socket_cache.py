"""A Responses WebSocket's cache of its newest chain (`service/socket.py`), against the memory store: read
like the store's `load_recent_chain`, within the same byte budget, and falling back to the store."""

from __future__ import annotations

import time

import pytest

from harmony_gateway.errors import InvalidRequest
from harmony_gateway.storage.base import StoredResponse, replay_size
from harmony_gateway.storage.memory import MemoryStore
from harmony_gateway.surfaces.responses.service.socket import SocketCache, event_encoder, stream_id_of

OWNER = "tenant"


def record(response_id: str, previous: str | None = None, text: str = "x") -> StoredResponse:
    return StoredResponse(
        id=response_id,
        owner=OWNER,
        created_at=int(time.time()),
        updated_at=time.time(),
        status="completed",
        model="m",
        response={"id": response_id, "output": []},
        history=[{"role": "user", "text": text}],
        previous_response_id=previous,
    )


async def chain_of(cache: SocketCache, ids: list[str], *, max_bytes: int | None = None) -> SocketCache:
    """`ids` completed one after another on the socket, each continuing the one before."""
    previous = None
    for response_id in ids:
        cache.begin_turn()
        if previous is not None:
            await cache.load_recent_chain(previous, OWNER, max_bytes=max_bytes)
        cache.remember(record(response_id, previous))
        previous = response_id
    return cache


async def test_the_newest_chain_is_read_from_the_cache() -> None:
    cache = await chain_of(SocketCache(MemoryStore()), ["r1", "r2", "r3"])
    assert cache.ids() == ["r1", "r2", "r3"]
    chain = await cache.load_recent_chain("r3", OWNER, max_bytes=None)
    assert [r.id for r in chain.responses] == ["r1", "r2", "r3"] and not chain.omitted
    assert cache.source == "cache"


async def test_a_fork_from_an_ancestor_becomes_the_cached_chain() -> None:
    cache = await chain_of(SocketCache(MemoryStore()), ["r1", "r2", "r3"])
    cache.begin_turn()
    chain = await cache.load_recent_chain("r1", OWNER, max_bytes=None)
    assert [r.id for r in chain.responses] == ["r1"]
    cache.remember(record("fork", "r1"))
    assert cache.ids() == ["r1", "fork"]


async def test_the_cache_keeps_what_the_byte_budget_lets_a_turn_read() -> None:
    one = replay_size(record("r1"))
    cache = await chain_of(SocketCache(MemoryStore()), ["r1", "r2", "r3", "r4"], max_bytes=2 * one)
    assert cache.ids() == ["r3", "r4"]
    chain = await cache.load_recent_chain("r4", OWNER, max_bytes=2 * one)
    assert [r.id for r in chain.responses] == ["r3", "r4"] and chain.omitted  # older ones existed
    chain = await cache.load_recent_chain("r4", OWNER, max_bytes=one)
    assert [r.id for r in chain.responses] == ["r4"] and chain.omitted


async def test_a_response_not_cached_is_read_from_the_store() -> None:
    store = MemoryStore()
    await store.start()
    await store.put_response(record("stored"))
    cache = SocketCache(store)
    cache.begin_turn()
    chain = await cache.load_recent_chain("stored", OWNER, max_bytes=None)
    assert [r.id for r in chain.responses] == ["stored"] and cache.source == "store"
    cache.remember(record("next", "stored"))
    assert cache.ids() == ["stored", "next"]
    with pytest.raises(InvalidRequest) as missing:
        await cache.load_recent_chain("nowhere", OWNER, max_bytes=None)
    assert missing.value.code == "previous_response_not_found"
    with pytest.raises(InvalidRequest):
        await cache.load_recent_chain("next", "another tenant", max_bytes=None)
    await store.close()


async def test_a_turn_that_loads_nothing_starts_a_new_chain() -> None:
    cache = await chain_of(SocketCache(MemoryStore()), ["r1", "r2"])
    cache.begin_turn()
    cache.remember(record("fresh"))
    assert cache.ids() == ["fresh"] and cache.source is None


def test_stream_ids_are_checked_and_echoed() -> None:
    assert stream_id_of({}) is None and stream_id_of({"stream_id": "agent_1.a-b"}) == "agent_1.a-b"
    for bad in ("", "a b", "x" * 257, 3):
        with pytest.raises(InvalidRequest):
            stream_id_of({"stream_id": bad})
    assert event_encoder("lane")({"type": "t"}) == b'{"type":"t","stream_id":"lane"}\n'
    assert event_encoder(None)({"type": "t"}) == b'{"type":"t"}\n'
