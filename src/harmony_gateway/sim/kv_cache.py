"""The simulated engine's KV cache: fixed-size blocks of token ids chained into prefixes.

`BlockCache` holds what a paged engine's prefix cache holds. A block is `block_size` token ids plus its
parent (the block before it in the prompt); a prompt's cached tokens are its leading full blocks found in
the cache. Blocks used by running requests are pinned (a reference count); the rest sit in LRU order and
are evicted, leaves first, when a request needs room. The capacity counts physical blocks: cached blocks
(vLLM may hold two copies of one block) plus the blocks running requests have reserved and not stored yet.

Every change is reported to `on_change` as a `KvChange` (stored runs, removals, clears) in the order it
happened; the relay (`kv_relay.py`) numbers and publishes them. Blocks carry the engine's own hash
(`HashStyle`): SGLang's per-page SHA-256 chain (high 64 bits, signed), vLLM's `sha256_cbor` chain (low
64 bits), or an opaque 64-bit chain for TRT-LLM. Lookups use cheap chain keys of Python's own tuple hash;
the engine hashes are computed once per stored block, and only when events are published.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

HashStyle = Literal["sglang", "vllm", "trtllm"]

_U64 = (1 << 64) - 1
_SIGN = 1 << 63


def _signed64(value: int) -> int:
    value &= _U64
    return value - (1 << 64) if value & _SIGN else value


def _cbor_uint(major: int, value: int) -> bytes:
    head = major << 5
    if value < 24:
        return bytes((head | value,))
    if value < 0x100:
        return bytes((head | 24, value))
    if value < 0x10000:
        return bytes((head | 25,)) + value.to_bytes(2, "big")
    if value < 0x1_0000_0000:
        return bytes((head | 26,)) + value.to_bytes(4, "big")
    return bytes((head | 27,)) + value.to_bytes(8, "big")


#: vLLM's root parent: SHA-256 of the CBOR text "vllm-none-hash".
VLLM_NONE_HASH = hashlib.sha256(_cbor_uint(3, 14) + b"vllm-none-hash").digest()


def sglang_digest(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """One SGLang page: SHA-256 over the parent's digest (none for the first page) and each token id as
    four little-endian bytes."""
    hasher = hashlib.sha256()
    if parent is not None:
        hasher.update(parent)
    hasher.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return hasher.digest()


def vllm_digest(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """One vLLM `sha256_cbor` block: SHA-256 of the canonical CBOR of `[parent, [tokens], None]`, with
    `VLLM_NONE_HASH` as the first block's parent (no LoRA, salt or multimodal keys)."""
    out = bytearray(b"\x83\x58\x20")
    out += parent if parent is not None else VLLM_NONE_HASH
    out += _cbor_uint(4, len(tokens))
    for token in tokens:
        out += _cbor_uint(0, token)
    out.append(0xF6)
    return hashlib.sha256(out).digest()


def trtllm_digest(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """An opaque 64-bit chain (BLAKE2b over the parent's digest and the token ids)."""
    hasher = hashlib.blake2b(digest_size=8)
    if parent is not None:
        hasher.update(parent)
    hasher.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return hasher.digest()


def published_hash(style: HashStyle, digest: bytes) -> int:
    """The signed 64-bit block hash the engine publishes for `digest`: SGLang sends the first eight bytes,
    vLLM the last eight (both big-endian, as the relay carries them in an int64)."""
    if style == "sglang":
        return int.from_bytes(digest[:8], "big", signed=True)
    return _signed64(int.from_bytes(digest[-8:], "big"))


_DIGESTS: dict[HashStyle, Callable[[bytes | None, Sequence[int]], bytes]] = {
    "sglang": sglang_digest,
    "vllm": vllm_digest,
    "trtllm": trtllm_digest,
}


def engine_hashes(style: HashStyle, ids: Sequence[int], block_size: int) -> list[int]:
    """The published hashes of every full block of `ids`, from the root: what the engine's events name."""
    digest_of = _DIGESTS[style]
    out: list[int] = []
    parent: bytes | None = None
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = digest_of(parent, ids[start : start + block_size])
        out.append(published_hash(style, parent))
    return out


class Block:
    """One cached block. `refs` counts the running requests using it; `copies` the physical copies the
    engine holds (vLLM stores a block twice when two requests computed it at once)."""

    __slots__ = ("children", "copies", "digest", "hash", "key", "parent", "refs", "tokens")

    def __init__(
        self, key: int, parent: Block | None, tokens: tuple[int, ...], digest: bytes, block_hash: int
    ) -> None:
        self.key = key
        self.parent = parent
        self.tokens = tokens
        self.digest = digest
        self.hash = block_hash
        self.refs = 0
        self.copies = 1
        self.children = 0


@dataclass(frozen=True, slots=True)
class StoredRun:
    """Blocks stored as one chain: `hashes[i]`'s parent is `hashes[i - 1]`, the first's `parent_hash`
    (None for a prompt's first block)."""

    parent_hash: int | None
    hashes: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    """Blocks evicted or removed; a hash appears once per physical copy."""

    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ClearedAll:
    pass


KvChange = StoredRun | RemovedBlocks | ClearedAll


def chain_keys(
    ids: Sequence[int], block_size: int, count: int, parent_key: int = 0, start: int = 0
) -> list[int]:
    """Lookup keys of `count` blocks of `ids` from token `start`, chained from `parent_key` (0: the root)."""
    keys: list[int] = []
    key = parent_key
    for begin in range(start, start + count * block_size, block_size):
        key = hash((key, tuple(ids[begin : begin + block_size])))
        keys.append(key)
    return keys


class BlockCache:
    """Blocks by chain key, pinned or in LRU order, within `capacity_blocks` physical blocks."""

    def __init__(
        self,
        block_size: int,
        capacity_blocks: int,
        style: HashStyle,
        on_change: Callable[[KvChange], None] | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self.capacity_blocks = max(1, capacity_blocks)
        self.style = style
        self._digest = _DIGESTS[style]
        self._on_change = on_change
        # Insertion order is store order, so iterating it lists parents before children.
        self._blocks: dict[int, Block] = {}
        #: Unpinned blocks, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        #: Physical blocks held: every cached copy.
        self.physical = 0
        #: Physical blocks no request uses: what eviction can reclaim.
        self.evictable = 0
        #: Blocks running requests reserved and have not stored yet.
        self.reserved = 0
        self.evicted = 0

    # -- reading --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    @property
    def pinned_physical(self) -> int:
        """Physical blocks running requests use: what eviction cannot reclaim (with `reserved`)."""
        return self.physical - self.evictable

    def blocks(self) -> Iterator[Block]:
        """Every cached block, parents before children."""
        return iter(self._blocks.values())

    def match(self, keys: Sequence[int]) -> int:
        """How many of `keys` are cached, from the first."""
        blocks = self._blocks
        for index, key in enumerate(keys):
            if key not in blocks:
                return index
        return len(keys)

    def get(self, key: int) -> Block | None:
        return self._blocks.get(key)

    # -- requests ---------------------------------------------------------------------------------

    def pin(self, keys: Sequence[int]) -> list[Block]:
        """Pin the cached blocks of `keys` (all must be cached) for a request."""
        pinned: list[Block] = []
        for key in keys:
            block = self._blocks[key]
            if block.refs == 0:
                self._lru.pop(key, None)
                self.evictable -= block.copies
            block.refs += 1
            pinned.append(block)
        return pinned

    def unpin(self, blocks: Sequence[Block]) -> None:
        """Release a request's blocks, given in chain order. The tail goes to the LRU end first, so the
        leaves of a prefix are evicted before the blocks they extend."""
        for block in reversed(blocks):
            if self._blocks.get(block.key) is not block:
                continue  # cleared while pinned
            block.refs -= 1
            if block.refs == 0:
                self._lru[block.key] = None
                self.evictable += block.copies

    def make_room(self, blocks: int) -> bool:
        """Evict unpinned leaves, least recently used first, until `blocks` more physical blocks fit;
        False (having evicted what it could) when they cannot."""
        over = self.physical + self.reserved + blocks - self.capacity_blocks
        if over <= 0:
            return True
        removed: list[int] = []
        while over > 0 and self._lru:
            block = self._leaf_to_evict()
            self._drop(block)
            removed.extend([block.hash] * block.copies)
            over -= block.copies
        if removed:
            self.evicted += len(removed)
            self._emit(RemovedBlocks(tuple(removed)))
        return over <= 0

    def _leaf_to_evict(self) -> Block:
        # Parents are used at least as recently as their children, so the first unpinned block is a leaf
        # but for ties; an unpinned block with cached children has an unpinned leaf below it.
        for key in self._lru:
            block = self._blocks[key]
            if block.children == 0:
                return block
        return self._blocks[next(iter(self._lru))]

    def _drop(self, block: Block) -> None:
        del self._blocks[block.key]
        if block.refs == 0:
            self._lru.pop(block.key, None)
            self.evictable -= block.copies
        self.physical -= block.copies
        if block.parent is not None and self._blocks.get(block.parent.key) is block.parent:
            block.parent.children -= 1

    def store(
        self,
        ids: Sequence[int],
        keys: Sequence[int],
        pinned: list[Block],
        end: int,
        *,
        copies: bool,
    ) -> None:
        """Store blocks `len(pinned)..end` of `ids` (keys given) as computed by a request holding
        `pinned`, and pin them for it. A block already cached is shared (SGLang's radix tree), or with
        `copies` held once more as a physical copy (vLLM). One `StoredRun` per run of stored blocks."""
        blocks = self._blocks
        size = self.block_size
        prev = pinned[-1] if pinned else None
        run: list[Block] = []
        run_parent: Block | None = prev
        changes: list[KvChange] = []
        for index in range(len(pinned), end):
            key = keys[index]
            block = blocks.get(key)
            if block is None:
                tokens = tuple(ids[index * size : (index + 1) * size])
                if self._on_change is not None:
                    digest = self._digest(prev.digest if prev is not None else None, tokens)
                    block = Block(key, prev, tokens, digest, published_hash(self.style, digest))
                else:
                    block = Block(key, prev, tokens, b"", key)
                blocks[key] = block
                if prev is not None and blocks.get(prev.key) is prev:
                    prev.children += 1
                self.physical += 1
                block.refs = 1
                run.append(block)
                pinned.append(block)
                prev = block
                continue
            if copies:
                block.copies += 1
                self.physical += 1
                if block.refs == 0:
                    self.evictable += 1
                run.append(block)
            else:
                if run:
                    changes.append(self._run(run_parent, run))
                    run = []
                run_parent = block
            if block.refs == 0:
                self._lru.pop(key, None)
                self.evictable -= block.copies
            block.refs += 1
            pinned.append(block)
            prev = block
        if run:
            changes.append(self._run(run_parent, run))
        for change in changes:
            self._emit(change)

    @staticmethod
    def _run(parent: Block | None, run: list[Block]) -> StoredRun:
        return StoredRun(
            parent.hash if parent is not None else None,
            tuple(block.hash for block in run),
            tuple(block.tokens for block in run),
        )

    # -- controls ---------------------------------------------------------------------------------

    def announce(self, ids: Sequence[int]) -> int:
        """Store every full block of `ids` unpinned, as a request elsewhere would have; returns how many
        blocks were new. Evicts to make room; stores what fits."""
        count = len(ids) // self.block_size
        keys = chain_keys(ids, self.block_size, count)
        have = self.match(keys)
        pinned = self.pin(keys[:have])
        fits = count
        if not self.make_room(count - have):
            fits = have + max(0, self.capacity_blocks - self.physical - self.reserved)
        self.store(ids, keys, pinned, min(count, fits), copies=False)
        self.unpin(pinned)
        return max(0, min(count, fits) - have)

    def remove_from(self, ids: Sequence[int], from_token: int = 0) -> int:
        """Remove the cached blocks of `ids` from the block holding `from_token` on, with every cached
        block that extends them; pinned blocks stay. Returns the physical blocks removed."""
        size = self.block_size
        first = from_token // size
        keys = chain_keys(ids, size, len(ids) // size)
        have = self.match(keys)
        if first >= have:
            return 0
        doomed = {keys[index] for index in range(first, have)}
        # Descendants come after their parents in store order: one pass collects the subtree.
        removed: list[Block] = []
        for block in self._blocks.values():
            if block.key in doomed or (block.parent is not None and block.parent.key in doomed):
                doomed.add(block.key)
                if block.refs == 0:
                    removed.append(block)
        hashes: list[int] = []
        for block in reversed(removed):  # leaves first
            if block.children == 0:
                self._drop(block)
                hashes.extend([block.hash] * block.copies)
        if hashes:
            self._emit(RemovedBlocks(tuple(hashes)))
        return len(hashes)

    def clear(self, *, publish: bool = True) -> None:
        """Forget every block (a flush): one `ClearedAll` unless not `publish` (a restarted engine starts
        empty). Requests still holding pinned blocks keep their reservations; their pins are released
        as no-ops."""
        self._blocks.clear()
        self._lru.clear()
        self.physical = 0
        self.evictable = 0
        if publish:
            self._emit(ClearedAll())

    def _emit(self, change: KvChange) -> None:
        if self._on_change is not None:
            self._on_change(change)


__all__ = [
    "VLLM_NONE_HASH",
    "Block",
    "BlockCache",
    "ClearedAll",
    "HashStyle",
    "KvChange",
    "RemovedBlocks",
    "StoredRun",
    "chain_keys",
    "engine_hashes",
    "published_hash",
    "sglang_digest",
    "trtllm_digest",
    "vllm_digest",
]
