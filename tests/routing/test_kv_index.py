"""The per-worker prefix index against a reference model of what the engine holds: stores (chained,
namespaced, with copies), removals, clears per rank, the block cap with its eviction order, and the
prompt hashes reused across workers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harmony_gateway.engines.kv_events import BlocksRemoved, BlocksStored, CacheCleared
from harmony_gateway.routing import kv_index
from harmony_gateway.routing.kv_index import COPIES_CAP, KvIndex

BLOCK = 4
NAMESPACES = [("", ""), ("lora-a", ""), ("", "salt-1")]
# Prompts over a tiny vocabulary share prefixes, so chains fork and blocks are shared.
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0],
    [1, 2, 3, 4, 9, 9, 9, 9, 1, 2, 3, 4],
    [7, 7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
]

Key = tuple[str, str, tuple[int, ...]]


def key(namespace: tuple[str, str], prompt: Sequence[int], blocks: int) -> Key:
    """What identifies a block's content: its namespace and every token up to its end."""
    return (*namespace, tuple(prompt[: blocks * BLOCK]))


class Engine:
    """The reference: copies per content block and rank, as the engine reports them (counted up to the
    cap, as the index counts them); engine hashes are arbitrary but stable per content."""

    def __init__(self) -> None:
        self.held: dict[int, dict[Key, int]] = {}
        self._hashes: dict[Key, int] = {}

    def engine_hash(self, k: Key) -> int:
        return self._hashes.setdefault(k, 1_000_003 * (len(self._hashes) + 1) % 2**63)

    def holds(self, rank: int, k: Key) -> bool:
        return self.held.get(rank, {}).get(k, 0) > 0

    def store(self, rank: int, k: Key) -> None:
        copies = self.held.setdefault(rank, {})
        copies[k] = min(copies.get(k, 0) + 1, COPIES_CAP)

    def remove(self, rank: int, k: Key) -> None:
        copies = self.held[rank]
        copies[k] -= 1
        if not copies[k]:
            del copies[k]

    def matched(self, namespace: tuple[str, str], prompt: Sequence[int]) -> int:
        held = {k for ranks in self.held.values() for k in ranks}
        n = 0
        while (n + 1) * BLOCK <= len(prompt) and key(namespace, prompt, n + 1) in held:
            n += 1
        return n * BLOCK

    def distinct(self) -> int:
        return len({k for ranks in self.held.values() for k in ranks})


def stored_event(engine: Engine, namespace: tuple[str, str], prompt: Sequence[int], start: int, end: int):
    """The engine's store of blocks [start, end) of `prompt`, chained from block start-1."""
    keys = [key(namespace, prompt, i + 1) for i in range(start, end)]
    parent = engine.engine_hash(key(namespace, prompt, start)) if start else None
    return BlocksStored(
        hashes=tuple(engine.engine_hash(k) for k in keys),
        token_ids=tuple(tuple(prompt[i * BLOCK : (i + 1) * BLOCK]) for i in range(start, end)),
        parent_hash=parent,
        lora_name=namespace[0],
        cache_salt=namespace[1],
    )


class IndexMachine(RuleBasedStateMachine):
    """Engine-consistent event sequences (a block is stored only while its parent is held on that rank)
    applied to the index; without a cap the index must agree with the engine exactly."""

    cap: int | None = None

    @initialize()
    def start(self) -> None:
        self.engine = Engine()
        self.index = KvIndex(max_blocks=self.cap or 10**9)

    @rule(
        rank=st.sampled_from([0, 1]),
        namespace=st.sampled_from(NAMESPACES),
        prompt=st.sampled_from(PROMPTS),
        start=st.integers(0, 4),
        length=st.integers(1, 3),
    )
    def store(
        self, rank: int, namespace: tuple[str, str], prompt: list[int], start: int, length: int
    ) -> None:
        end = min(start + length, len(prompt) // BLOCK)
        if start >= end or (start and not self.engine.holds(rank, key(namespace, prompt, start))):
            return
        event = stored_event(self.engine, namespace, prompt, start, end)
        for i in range(start, end):
            self.engine.store(rank, key(namespace, prompt, i + 1))
        self.index.apply([event], rank)

    @rule(
        rank=st.sampled_from([0, 1]),
        namespace=st.sampled_from(NAMESPACES),
        prompt=st.sampled_from(PROMPTS),
        length=st.integers(1, 3),
    )
    def extend(self, rank: int, namespace: tuple[str, str], prompt: list[int], length: int) -> None:
        """Store the blocks after the longest prefix the rank holds (a turn that goes on)."""
        start = 0
        while start < len(prompt) // BLOCK and self.engine.holds(rank, key(namespace, prompt, start + 1)):
            start += 1
        self.store(rank, namespace, prompt, start, length)

    @precondition(lambda self: any(self.engine.held.values()))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        rank = data.draw(st.sampled_from([r for r, held in self.engine.held.items() if held]))
        k = data.draw(st.sampled_from(sorted(self.engine.held[rank])))
        self.engine.remove(rank, k)
        self.index.apply([BlocksRemoved((self.engine.engine_hash(k),))], rank)

    @rule(rank=st.sampled_from([0, 1]))
    def clear(self, rank: int) -> None:
        self.engine.held.pop(rank, None)
        self.index.apply([CacheCleared()], rank)

    @rule(rank=st.sampled_from([0, 1]), prompt=st.sampled_from(PROMPTS))
    def store_elsewhere(self, rank: int, prompt: list[int]) -> None:
        """A host-tier store and removal: not the engine's prefix cache, never indexed."""
        event = stored_event(self.engine, ("", ""), prompt, 0, 1)
        self.index.apply([BlocksStored(event.hashes, event.token_ids, None, indexable=False)], rank)
        self.index.apply([BlocksRemoved(event.hashes, indexable=False)], rank)

    @invariant()
    def agrees_with_the_engine(self) -> None:
        if self.cap is not None:
            return
        assert len(self.index) == self.engine.distinct()
        for namespace in NAMESPACES:
            for prompt in PROMPTS:
                assert self.index.matched_tokens(prompt, *namespace) == self.engine.matched(namespace, prompt)


class CappedIndexMachine(IndexMachine):
    """With a cap: the index never exceeds it and never claims a block the engine does not hold; until it
    evicts, it agrees with the engine exactly although it tracks leaves (above half the cap)."""

    cap = 6

    @invariant()
    def bounded_and_sound(self) -> None:
        assert len(self.index) <= self.cap
        check_eviction_records(self.index)
        exact = self.index.counters.evicted == 0
        event("evicted" if not exact else "tracking" if self.index._tracking else "untracked")
        for namespace in NAMESPACES:
            for prompt in PROMPTS:
                matched = self.index.matched_tokens(prompt, *namespace)
                expected = self.engine.matched(namespace, prompt)
                assert matched == expected if exact else matched <= expected


def check_eviction_records(index: KvIndex) -> None:
    """While the index tracks eviction, its children counts and leaves are what its parent links say."""
    if not index._tracking:
        return
    assert index._children == dict(Counter(index._parent.values()))
    assert set(index._leaves) == {own for own in index._refs if own not in index._children}


_settings = settings(max_examples=150, stateful_step_count=40, suppress_health_check=[HealthCheck.too_slow])
TestIndexAgreesWithTheEngine = IndexMachine.TestCase
TestIndexAgreesWithTheEngine.settings = _settings
TestCappedIndexStaysSound = CappedIndexMachine.TestCase
TestCappedIndexStaysSound.settings = _settings


def test_a_block_leaves_with_its_last_copy() -> None:
    engine, index = Engine(), KvIndex()
    prompt = PROMPTS[0]
    event = stored_event(engine, ("", ""), prompt, 0, 2)
    index.apply([event, event])  # vLLM's second physical copy of the same blocks
    assert index.matched_tokens(prompt) == 2 * BLOCK
    index.apply([BlocksRemoved(event.hashes[1:])])
    assert index.matched_tokens(prompt) == 2 * BLOCK
    index.apply([BlocksRemoved(event.hashes[1:])])
    assert index.matched_tokens(prompt) == BLOCK
    assert len(index) == 1


def test_copies_are_counted_up_to_the_cap() -> None:
    engine, index = Engine(), KvIndex()
    event = stored_event(engine, ("", ""), PROMPTS[0], 0, 1)
    index.apply([event] * (COPIES_CAP + 3))
    index.apply([BlocksRemoved(event.hashes)] * (COPIES_CAP - 1))
    assert len(index) == 1
    index.apply([BlocksRemoved(event.hashes)])
    assert len(index) == 0


def test_namespaces_and_block_size() -> None:
    engine, index = Engine(), KvIndex()
    index.apply([stored_event(engine, ("", "salt-1"), PROMPTS[0], 0, 3)])
    assert index.block_size == BLOCK
    assert index.matched_tokens(PROMPTS[0], cache_salt="salt-1") == 3 * BLOCK
    assert index.matched_tokens(PROMPTS[0]) == 0  # another tenant's salt never matches
    assert index.matched_tokens(PROMPTS[0], lora_name="lora-a", cache_salt="salt-1") == 0
    assert index.matched_tokens(PROMPTS[0][:7], cache_salt="salt-1") == BLOCK  # full blocks only
    # A store of another block size cannot be matched against prompts cut in this one.
    other = BlocksStored((99,), ((1, 2, 3, 4, 5, 6, 7, 8),), None)
    index.apply([other])
    assert index.counters.misaligned == 1 and len(index) == 3


def test_a_store_whose_parent_is_unknown_is_dropped() -> None:
    engine, index = Engine(), KvIndex()
    index.apply([stored_event(engine, ("", ""), PROMPTS[0], 1, 3)])
    assert len(index) == 0 and index.counters.orphaned == 1


def test_a_clear_on_one_rank_keeps_the_others() -> None:
    engine, index = Engine(), KvIndex()
    index.apply([stored_event(engine, ("", ""), PROMPTS[0], 0, 2)], rank=0)
    index.apply([stored_event(engine, ("", ""), PROMPTS[3], 0, 1)], rank=1)
    index.apply([CacheCleared()], rank=0)
    assert index.matched_tokens(PROMPTS[0]) == 0 and index.matched_tokens(PROMPTS[3]) == BLOCK
    index.clear()
    assert len(index) == 0 and index.matched_tokens(PROMPTS[3]) == 0


def test_complete_only_when_every_rank_is_known() -> None:
    index = KvIndex()
    assert not index.complete
    index.mark(0, True)
    assert index.complete
    index.mark(1, False)
    assert not index.complete
    index.mark(1, True)
    assert index.complete
    index.forget_ranks()
    assert not index.complete


def test_over_the_cap_the_least_recently_used_branch_goes_from_its_tip() -> None:
    engine, index = Engine(), KvIndex(max_blocks=4)
    a, b, c, d = PROMPTS[0], PROMPTS[3], PROMPTS[2][4:], [5, 5, 5, 5]
    index.apply([stored_event(engine, ("", ""), a, 0, 2)])
    index.apply([stored_event(engine, ("", ""), b, 0, 2)])
    assert index.matched_tokens(a) == 2 * BLOCK  # a is used after b was stored
    index.apply([stored_event(engine, ("", ""), c, 0, 1)])  # 5 blocks: b's tip goes
    assert len(index) == 4 and index.counters.evicted == 1
    index.apply([stored_event(engine, ("", ""), d, 0, 1)])  # then b's root, a leaf now and the oldest
    assert [index.matched_tokens(p) for p in (a, c, d, b)] == [2 * BLOCK, BLOCK, BLOCK, 0]
    assert index.counters.evicted == 2
    # A child stored under an evicted parent cannot be placed.
    index.apply([stored_event(engine, ("", ""), b, 1, 2)])
    assert index.counters.orphaned == 1


def test_a_removed_child_hands_its_use_to_its_parent() -> None:
    engine, index = Engine(), KvIndex(max_blocks=3)
    a, b = PROMPTS[0], PROMPTS[3]
    index.apply([stored_event(engine, ("", ""), a, 0, 2)])
    index.apply([stored_event(engine, ("", ""), b, 0, 1)])
    index.matched_tokens(a)  # a's tip is now the most recently used block
    index.apply([BlocksRemoved((engine.engine_hash(key(("", ""), a, 2)),))])
    index.apply([stored_event(engine, ("", ""), [6] * 8, 0, 2)])  # 4 blocks: one must go
    assert index.matched_tokens(a) == BLOCK and index.matched_tokens(b) == 0


def test_a_parent_that_comes_back_keeps_the_children_that_stayed() -> None:
    engine, index = Engine(), KvIndex(max_blocks=4)  # leaves are tracked above 2 blocks
    a, b = PROMPTS[0], PROMPTS[1]  # sharing their first two blocks
    index.apply([stored_event(engine, ("", ""), a, 0, 3)])
    index.apply([BlocksRemoved((engine.engine_hash(key(("", ""), a, 2)),))])  # a middle block goes
    index.apply([stored_event(engine, ("", ""), b, 1, 3)])  # it comes back with another child
    check_eviction_records(index)
    for gone in (key(("", ""), b, 3), key(("", ""), a, 3)):
        index.apply([BlocksRemoved((engine.engine_hash(gone),))])
        check_eviction_records(index)
    assert [index.matched_tokens(a), index.matched_tokens(b), len(index)] == [2 * BLOCK, 2 * BLOCK, 2]


def test_the_prompt_is_hashed_once_for_every_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    step = kv_index._chain_step

    def counting(parent: int, tokens: tuple[int, ...]) -> int:
        nonlocal calls
        calls += 1
        return step(parent, tokens)

    monkeypatch.setattr(kv_index, "_chain_step", counting)
    engine = Engine()
    prompt = list(PROMPTS[4])
    indexes = [KvIndex() for _ in range(4)]
    for index in indexes:
        index.apply([stored_event(engine, ("", ""), prompt, 0, 4)])
    assert [index.matched_tokens(prompt) for index in indexes] == [4 * BLOCK] * 4
    assert calls == len(prompt) // BLOCK  # every block hashed once, for all four workers
    assert indexes[0].matched_tokens(list(prompt)) == 4 * BLOCK  # an equal prompt, another object
    assert calls == 2 * (len(prompt) // BLOCK)
    assert kv_index.block_hashes(prompt, BLOCK, kv_index.namespace_seed("", ""))[:4] == [
        h for h in kv_index.block_hashes(prompt[:16], BLOCK, kv_index.namespace_seed("", ""))
    ]
