"""`KvIndex`: one worker's prefix cache as its engine reports it, built from its KV events.

The index never trusts the engine's block hashes for matching (each engine hashes its own way: SGLang
SHA-256 pages, vLLM CBOR digests, TRT-LLM its own); it chains a content hash of its own per block:
a root block hashes its tokens with a seed made of the cache namespace (LoRA name, cache salt), every
other block its tokens with its parent's hash, so a block's hash covers the namespace and every token
before it. A prompt is hashed the same way, block by block, and `matched_tokens` walks its leading full
blocks while the index holds them. The hashes are Python's tuple hash over ints from a per-process
random seed: fast in C, 64 bits wide, not predictable from outside the process; a collision costs a
routing guess, never an answer (the engine matches its own cache).

The engine's hashes map to the index's, per data-parallel rank, to apply removals: an engine may store
one hash more than once (vLLM keeps up to two physical copies; counted up to `COPIES_CAP`, as the
servicers' relay counts them), each removal takes one copy, and a block leaves when no copy of it is
left on any rank. A store whose parent the index does not hold (stored before the subscription, or
evicted here) cannot be placed in a chain and is dropped (`Counters.orphaned`).

Memory is bounded by `max_blocks`. Past it, the least recently used leaf goes first: a block no held
block chains from, whose last use (a store, or a prompt match that ended on it or on a block after it,
since a removed child hands its use on to its parent) is the oldest. A branch is pruned from its tip
back towards where it joins a branch still in use. A leaf that appears because its last child left is
placed by its own use: before every other leaf when it is the oldest, else as recently used (the order
is exact but for that case, which errs towards keeping a block).

`complete` is what routing asks before trusting the index over its own record: every rank the index
has seen is known from a point where the engine's cache was known (its first batch, a cleared cache, a
whole snapshot), with no gap since. The subscriber decides that (`mark`); the index only keeps it.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, islice

from ..engines.kv_events import BlocksRemoved, BlocksStored, CacheCleared, KvEvent

#: Blocks one worker's index holds at most (of 16 tokens: 4M tokens, more than an engine's device cache
#: on common hardware; about 200 bytes a block, 260 while eviction is tracked).
DEFAULT_MAX_BLOCKS = 262_144
#: Physical copies of one engine hash counted per rank, as the servicers' relay counts them.
COPIES_CAP = 8
# A held block's entry: its last use (a tick) above `_USE_SHIFT` bits of copies.
_USE_SHIFT = 20
_COPIES = (1 << _USE_SHIFT) - 1

_SEED = random.getrandbits(62)
_namespaces: dict[tuple[str, str], int] = {}


def namespace_seed(lora_name: str, cache_salt: str) -> int:
    """The hash a root block chains from: one per (LoRA name, cache salt) and process."""
    key = (lora_name, cache_salt)
    seed = _namespaces.get(key)
    if seed is None:
        if len(_namespaces) > 4096:
            _namespaces.clear()  # salts may be per tenant or per request: keep the memo small
        seed = _namespaces[key] = hash((_SEED, lora_name, cache_salt))
    return seed


def _chain_step(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def block_hashes(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    """The index's hashes of every full block of `tokens` chained from `seed` (for tests and tools;
    `matched_tokens` computes them lazily)."""
    blocks = zip(*[iter(tokens)] * block_size, strict=False)
    return list(islice(accumulate(blocks, _chain_step, initial=seed), 1, None))


class _PromptChain:
    """A prompt's block hashes for one block size and namespace, computed as far as a match needs."""

    __slots__ = ("_pending", "hashes")

    def __init__(self, tokens: Sequence[int], block_size: int, seed: int) -> None:
        blocks = zip(*[iter(tokens)] * block_size, strict=False)
        self._pending = accumulate(blocks, _chain_step, initial=seed)
        next(self._pending)  # the seed itself
        self.hashes: list[int] = []

    def grow(self) -> bool:
        """Hash the next blocks (as many as already hashed, at least 16); False when none are left."""
        before = len(self.hashes)
        self.hashes.extend(islice(self._pending, max(16, before)))
        return len(self.hashes) > before


class _PromptChains:
    """The last prompt's chains, by (block size, namespace seed): policies ask every worker about the
    same prompt object in turn, and each worker's index reuses the hashes the first one computed. The
    prompt is recognised by identity and length (it is held here until the next prompt replaces it)."""

    def __init__(self) -> None:
        self._tokens: Sequence[int] | None = None
        self._length = -1
        self._chains: dict[tuple[int, int], _PromptChain] = {}

    def chain(self, tokens: Sequence[int], block_size: int, seed: int) -> _PromptChain:
        if tokens is not self._tokens or len(tokens) != self._length:
            self._tokens, self._length = tokens, len(tokens)
            self._chains = {}
        key = (block_size, seed)
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = _PromptChain(tokens, block_size, seed)
        return chain


_prompts = _PromptChains()


@dataclass(slots=True)
class Counters:
    """What the index did not take as is, for logs and tests."""

    #: Stores dropped because their first block's parent is not held here.
    orphaned: int = 0
    #: Stores dropped because their block size is not the one the index learned.
    misaligned: int = 0
    #: Blocks dropped to stay within `max_blocks`.
    evicted: int = 0


class _Rank:
    """One data-parallel rank's engine hashes, each mapped to the index's hash of its block; `extra`
    counts the copies beyond the first."""

    __slots__ = ("blocks", "extra", "known")

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.extra: dict[int, int] = {}
        self.known = False


class KvIndex:
    """A worker's prefix index (`routing.workers.PrefixIndex`), fed by its KV-event subscription.

    Applying events (`apply`, `clear`) and matching (`matched_tokens`) run on the event loop and never
    wait; only the subscriber applies, policies only match. Blocks are kept in dicts of ints keyed by
    the index's hash (no object per block: nothing for the garbage collector to walk, a few dict
    entries of memory each). What eviction needs beyond the last uses (which blocks are leaves, in
    which order) is kept only while the index holds more than half its cap: below, the engine's own
    removals bound it, and every event costs less; crossing the half builds it from the parent links
    and uses in one pass (tens of milliseconds at the default cap), and it is dropped again below a
    quarter.
    """

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        #: The engine's block size in tokens, learned from the first store (0 until then).
        self.block_size = 0
        self.counters = Counters()
        # Held blocks: the last use (a tick) shifted left by `_USE_SHIFT` plus the copies held over every
        # rank and engine hash that maps to the block; and each block's parent (the namespace seed for
        # a root).
        self._refs: dict[int, int] = {}
        self._parent: dict[int, int] = {}
        # While eviction is tracked: held blocks linking to a hash, for every hash with any (held or
        # not; a block is a leaf when it has none), and the leaves, least recently used first.
        self._tracking = False
        self._track_above = max_blocks // 2
        self._children: dict[int, int] = {}
        self._leaves: OrderedDict[int, None] = OrderedDict()
        self._ranks: dict[int, _Rank] = {}
        self._tick = 0
        self._complete = False

    # -- what routing reads -------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return self._complete

    def __len__(self) -> int:
        return len(self._refs)

    def matched_tokens(self, input_ids: Sequence[int], lora_name: str = "", cache_salt: str = "") -> int:
        size = self.block_size
        held = self._refs
        if not size or not held or len(input_ids) < size:
            return 0
        chain = _prompts.chain(input_ids, size, namespace_seed(lora_name, cache_salt))
        hashes = chain.hashes
        matched = 0
        while True:
            if matched == len(hashes) and not chain.grow():
                break
            for own in islice(hashes, matched, None):
                if own not in held:
                    break
                matched += 1
            else:
                continue
            break
        if matched:
            self._touch(hashes[matched - 1])
        return matched * size

    # -- what the subscriber feeds --------------------------------------------------------------------
    def apply(self, events: Iterable[KvEvent], rank: int = 0) -> bool:
        """Apply one batch's events from `rank` in order; events that are not `indexable` are skipped.
        Returns whether one of them cleared the rank's cache."""
        cleared = False
        for event in events:
            kind = type(event)
            if kind is BlocksStored:
                if event.indexable:  # type: ignore[union-attr]
                    self._store(event, rank)  # type: ignore[arg-type]
            elif kind is BlocksRemoved:
                if event.indexable:  # type: ignore[union-attr]
                    self._remove(event, rank)  # type: ignore[arg-type]
            elif kind is CacheCleared:
                self.clear(rank)
                cleared = True
        return cleared

    def clear(self, rank: int | None = None) -> None:
        """Forget what `rank` holds (every rank's when None); blocks other ranks hold stay."""
        if rank is None or self._ranks.keys() <= {rank}:
            self._refs.clear()
            self._parent.clear()
            self._stop_tracking()
            for each in self._ranks.values():
                each.blocks.clear()
                each.extra.clear()
            return
        state = self._ranks.get(rank)
        if state is None:
            return
        for engine_hash, own in state.blocks.items():
            self._release(own, 1 + state.extra.get(engine_hash, 0))
        state.blocks.clear()
        state.extra.clear()

    def mark(self, rank: int, known: bool) -> None:
        """Record whether `rank`'s blocks are all known (see the module docstring)."""
        self._rank(rank).known = known
        self._complete = bool(self._ranks) and all(state.known for state in self._ranks.values())

    def known(self, rank: int) -> bool:
        state = self._ranks.get(rank)
        return state is not None and state.known

    def forget_ranks(self) -> None:
        """Drop every rank's state and every block: the subscription starts over."""
        self.clear()
        self._ranks.clear()
        self._complete = False

    # -- internals ------------------------------------------------------------------------------------
    def _rank(self, rank: int) -> _Rank:
        state = self._ranks.get(rank)
        if state is None:
            state = self._ranks[rank] = _Rank()
            self._complete = False
        return state

    def _store(self, event: BlocksStored, rank: int) -> None:
        token_ids = event.token_ids
        if not token_ids:
            return
        if len(token_ids[0]) != self.block_size:
            if self.block_size and self._refs:
                self.counters.misaligned += 1
                return
            self.block_size = len(token_ids[0])
        state = self._ranks.get(rank)
        if state is None:
            state = self._rank(rank)
        engine_blocks = state.blocks
        refs = self._refs
        parent_hash = event.parent_hash
        if parent_hash is None:
            own = namespace_seed(event.lora_name, event.cache_salt)
        else:
            parent = engine_blocks.get(parent_hash)
            if parent is None or parent not in refs:
                self.counters.orphaned += 1
                return
            own = parent
        parents = self._parent
        tracking = self._tracking
        children = self._children
        created = False  # whether the block before this one was created by this store
        for engine_hash, tokens in zip(event.hashes, token_ids, strict=False):
            parent = own
            own = hash((parent, tokens))
            if own not in refs:
                refs[own] = 1
                parents[own] = parent
                if tracking:
                    linked = children.get(parent, 0)
                    children[parent] = linked + 1
                    if not linked and not created:
                        self._leaves.pop(parent, None)  # a block made just now is no leaf yet
                created = True
                held = engine_blocks.setdefault(engine_hash, own)
                if held != own:
                    # The engine reused the hash for other content (or the block left here since): the
                    # mapping moves to this block.
                    engine_blocks[engine_hash] = own
                    self._release(held, 1 + state.extra.pop(engine_hash, 0))
                continue
            created = False
            mapped = engine_blocks.get(engine_hash)
            if mapped == own:
                extra = state.extra.get(engine_hash, 0)
                if extra < COPIES_CAP - 1:
                    state.extra[engine_hash] = extra + 1
                    refs[own] += 1
            else:
                engine_blocks[engine_hash] = own
                refs[own] += 1
                if mapped is not None:
                    self._release(mapped, 1 + state.extra.pop(engine_hash, 0))
        # Only the last block's use is recorded: every other block has a child now, which hands its
        # use on when it leaves.
        self._tick += 1
        refs[own] = self._tick << _USE_SHIFT | refs[own] & _COPIES
        if tracking:
            if own not in children:
                self._leaves[own] = None
                self._leaves.move_to_end(own)
            if len(refs) > self.max_blocks:
                self._evict()
        elif len(refs) > self._track_above:
            self._start_tracking()

    def _remove(self, event: BlocksRemoved, rank: int) -> None:
        state = self._ranks.get(rank)
        if state is None:
            return
        engine_blocks = state.blocks
        extra = state.extra
        refs = self._refs
        for engine_hash in event.hashes:
            own = engine_blocks.get(engine_hash)
            if own is None:
                continue
            copies = extra.get(engine_hash) if extra else None
            if copies:
                if copies == 1:
                    del extra[engine_hash]
                else:
                    extra[engine_hash] = copies - 1
            else:
                del engine_blocks[engine_hash]
            held = refs.get(own)
            if held is None:
                continue  # evicted here already
            if held & _COPIES > 1:
                refs[own] = held - 1
            else:
                self._drop(own)
        if self._tracking and len(refs) < self._track_above // 2:
            self._stop_tracking()

    def _release(self, own: int, copies: int) -> None:
        held = self._refs.get(own)
        if held is None:
            return  # evicted here already
        if held & _COPIES > copies:
            self._refs[own] = held - copies
        else:
            self._drop(own)

    def _drop(self, own: int) -> None:
        """The block `own` leaves the index; its parent inherits its last use and may become a leaf."""
        refs = self._refs
        used = refs.pop(own) >> _USE_SHIFT
        parent = self._parent.pop(own)
        held = refs.get(parent)
        if held is not None and used > held >> _USE_SHIFT:
            refs[parent] = held = used << _USE_SHIFT | held & _COPIES
        if not self._tracking:
            return
        leaves = self._leaves
        leaves.pop(own, None)
        children = self._children
        linked = children[parent] - 1
        if linked:
            children[parent] = linked
            return
        del children[parent]
        if held is None:
            return
        # A leaf again: placed by its use (the oldest goes first; a newer one errs towards staying).
        oldest = next(iter(leaves), None)
        leaves[parent] = None
        if oldest is not None and held >> _USE_SHIFT <= refs[oldest] >> _USE_SHIFT:
            leaves.move_to_end(parent, last=False)

    def _touch(self, own: int) -> None:
        self._tick += 1
        refs = self._refs
        refs[own] = self._tick << _USE_SHIFT | refs[own] & _COPIES
        if self._tracking and own not in self._children:
            self._leaves.move_to_end(own)

    def _start_tracking(self) -> None:
        """Build the children counts and the leaves in use order from the parent links."""
        refs = self._refs
        children = self._children = dict(Counter(self._parent.values()))
        leaves = [own for own in refs if own not in children]
        leaves.sort(key=lambda own: refs[own] >> _USE_SHIFT)
        self._leaves = OrderedDict.fromkeys(leaves)
        self._tracking = True
        if len(refs) > self.max_blocks:
            self._evict()

    def _stop_tracking(self) -> None:
        self._tracking = False
        self._children = {}
        self._leaves = OrderedDict()

    def _evict(self) -> None:
        refs = self._refs
        leaves = self._leaves
        while len(refs) > self.max_blocks and leaves:
            own, _ = leaves.popitem(last=False)
            self._drop(own)
            self.counters.evicted += 1


__all__ = ["COPIES_CAP", "DEFAULT_MAX_BLOCKS", "Counters", "KvIndex", "block_hashes", "namespace_seed"]
