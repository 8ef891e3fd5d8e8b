"""The twin's block cache on its own: engine hashes, LRU eviction of unused leaves, pins and capacity."""

from __future__ import annotations

from harmony_gateway.sim.kv_cache import (
    BlockCache,
    ClearedAll,
    KvChange,
    RemovedBlocks,
    StoredRun,
    chain_keys,
    engine_hashes,
)

#: Vectors of SGLang's per-page SHA-256 chain (high 64 bits, signed) and vLLM's `sha256_cbor` chain (low
#: 64 bits), as smg-grpc-servicer 0.14.1's hash check recomputes them for this input.
VECTOR_IDS = [*range(1000, 1048), *[200005, 199999, 5] * 6]
SGLANG_VECTOR = [5740554423035903369, -278502217879090434]
VLLM_VECTOR = [3753563854825738204, 2378715151359315973]


def test_engine_hashes_follow_each_engines_definition() -> None:
    assert engine_hashes("sglang", VECTOR_IDS, 16)[:2] == SGLANG_VECTOR
    assert engine_hashes("vllm", VECTOR_IDS, 16)[:2] == VLLM_VECTOR
    trt = engine_hashes("trtllm", VECTOR_IDS, 16)
    assert len(trt) == 4 and len(set(trt)) == 4
    # A chain: the same block after another parent hashes differently.
    assert engine_hashes("sglang", VECTOR_IDS[16:32], 16)[0] != SGLANG_VECTOR[1]


def stored_cache(capacity_blocks: int, changes: list[KvChange]) -> BlockCache:
    return BlockCache(4, capacity_blocks, "sglang", on_change=changes.append)


def store(cache: BlockCache, ids: list[int]) -> None:
    """Store every full block of `ids` as a finished request would, leaving them unpinned."""
    keys = chain_keys(ids, cache.block_size, len(ids) // cache.block_size)
    pinned = cache.pin(keys[: cache.match(keys)])
    cache.store(ids, keys, pinned, len(keys), copies=False)
    cache.unpin(pinned)


def test_a_store_names_its_parent_and_shares_what_is_cached() -> None:
    changes: list[KvChange] = []
    cache = stored_cache(100, changes)
    store(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    store(cache, [1, 2, 3, 4, 9, 9, 9, 9, 10, 10, 10, 10])
    first, second = changes
    assert isinstance(first, StoredRun) and isinstance(second, StoredRun)
    assert first.parent_hash is None and len(first.hashes) == 2
    # The shared first block is not stored again; the new run hangs off it.
    assert second.parent_hash == first.hashes[0]
    assert second.tokens == ((9, 9, 9, 9), (10, 10, 10, 10))
    assert len(cache) == 4 and cache.physical == 4


def test_eviction_takes_least_recently_used_leaves_first() -> None:
    changes: list[KvChange] = []
    cache = stored_cache(4, changes)
    store(cache, [1, 1, 1, 1, 2, 2, 2, 2])  # root r, leaf a
    store(cache, [1, 1, 1, 1, 3, 3, 3, 3])  # r again (touched), leaf b
    a_hash = changes[0].hashes[1]  # type: ignore[union-attr]
    root_hash = changes[0].hashes[0]  # type: ignore[union-attr]
    assert cache.make_room(2)
    removed = changes[-1]
    # The oldest leaf went; the shared root, used since, stayed.
    assert removed == RemovedBlocks((a_hash,))
    assert root_hash in {block.hash for block in cache.blocks()}
    assert cache.physical + 2 <= cache.capacity_blocks


def test_pinned_blocks_are_never_evicted() -> None:
    changes: list[KvChange] = []
    cache = stored_cache(2, changes)
    ids = [5, 5, 5, 5, 6, 6, 6, 6]
    store(cache, ids)
    keys = chain_keys(ids, 4, 2)
    pinned = cache.pin(keys)
    assert not cache.make_room(1)
    assert len(cache) == 2 and cache.pinned_physical == 2
    cache.unpin(pinned)
    assert cache.make_room(1)
    assert cache.physical == 1


def test_vllm_keeps_a_second_physical_copy_and_removes_every_copy() -> None:
    changes: list[KvChange] = []
    cache = BlockCache(4, 10, "vllm", on_change=changes.append)
    ids = [7, 7, 7, 7]
    keys = chain_keys(ids, 4, 1)
    one: list = []
    two: list = []
    cache.store(ids, keys, one, 1, copies=True)
    cache.store(ids, keys, two, 1, copies=True)
    assert len(cache) == 1 and cache.physical == 2
    assert changes[0] == changes[1]
    cache.unpin(one)
    cache.unpin(two)
    assert cache.make_room(10)
    assert changes[-1] == RemovedBlocks((changes[0].hashes[0],) * 2)  # type: ignore[union-attr]


def test_announce_remove_and_clear() -> None:
    changes: list[KvChange] = []
    cache = stored_cache(100, changes)
    ids = list(range(12))
    assert cache.announce(ids) == 3
    assert cache.announce(ids) == 0
    store(cache, [*ids[:8], 50, 51, 52, 53])  # a branch off the second block
    # Removing from the second block takes the branch under it too, leaves first.
    assert cache.remove_from(ids, from_token=4) == 3
    removed = changes[-1]
    assert isinstance(removed, RemovedBlocks) and len(removed.hashes) == 3
    assert len(cache) == 1
    cache.clear()
    assert changes[-1] == ClearedAll() and len(cache) == 0
