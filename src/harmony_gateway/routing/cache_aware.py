"""Cache-aware routing: send a prompt to the worker most likely to hold its prefix in KV cache.

The gateway cannot see the engines' caches, so it keeps an approximate one: a radix tree of every
prompt it routed, each node recording which workers were sent that prefix and when. This follows the
SGLang router's cache-aware policy: balance first when load is skewed, otherwise follow the longest
cached prefix when it covers enough of the prompt, otherwise spread by cache size.

The tree has one root per tenant (`RoutingRequest.tenant`) and every lookup starts at the caller's own
root, as does the `prompt_cache_key` map: a tenant's prompts and keys are matched only against its own,
so how much of a prompt is "cached" can never tell one tenant what another sent. The price is affinity
between tenants: two tenants sending the same system prompt are placed as strangers, and an engine may
hold that prefix twice. Worker sizes and eviction stay global, as the engines' KV caches are.
"""

from __future__ import annotations

import heapq
import itertools
import struct
from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Literal

from .policy import RoutingPolicy, RoutingRequest, available_workers, tenant_key
from .workers import Worker

#: Keys are byte strings of packed token ids (`unit` bytes per id) or text (one character per unit).
Key = bytes | str

CacheKey = Literal["tokens", "selection-text"]

# Token ids are packed as 4-byte ints so edge labels are compact byte strings compared with memcmp:
# 4 bytes per cached token instead of an 8-byte pointer plus a 28-byte int object. `struct.pack` is
# about 3x faster than `array(...).tobytes()` here (~8 ns per id).
_ID_BYTES = 4

# Eviction scans the evicting worker's part of the tree, so it frees down to this fraction of the bound
# rather than to the bound itself; the scan then runs once per ~10% of turnover, not on every insert.
_EVICT_TO = 0.9


def pack_token_ids(input_ids: Sequence[int]) -> bytes:
    """Token ids as the byte key the tree stores (`_ID_BYTES` bytes per id)."""
    return struct.pack(f"={len(input_ids)}i", *input_ids)


def _common_prefix(label: Key, key: Key, start: int, unit: int) -> int:
    """Length (in elements, a multiple of `unit`) of the common prefix of `label` and `key[start:]`.

    One slice comparison (memcmp for bytes) settles the usual case of a fully matching label; otherwise
    a binary search over slice comparisons finds the first mismatch: O(log n) steps whose comparisons
    halve in length, so O(n) element comparisons in C in total.
    """
    n = min(len(label), len(key) - start)
    if key[start : start + n] == label[:n]:
        return n
    # Invariant: label[:lo] == key[start : start + lo] and the first mismatch is in [lo, hi).
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if label[lo:mid] == key[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo - lo % unit


class _Node:
    __slots__ = ("children", "label", "parent", "workers")

    def __init__(self, label: Key, parent: _Node | None, workers: dict[str, int]) -> None:
        self.label = label
        self.parent = parent
        #: First symbol of the child's label -> child.
        self.children: dict[Key, _Node] = {}
        #: Worker id -> logical time this worker was last sent a prompt through this node.
        self.workers = workers


class PrefixTree:
    """One approximate radix tree per namespace, shared by all workers, with per-worker sizes and LRU
    eviction across namespaces.

    Every lookup and insert names its namespace and walks only that namespace's tree: no key of one
    namespace can match a node of another, whatever the two keys hold.

    Edges are compressed: a node's `label` is a run of symbols (`unit` elements of the key each). A
    worker listed on a node is listed on all its ancestors, so the deepest node on a prompt's path that
    lists a worker gives that worker's match length.

    Complexity, for a key of L symbols: `match` and `insert` are O(L) element comparisons done by slice
    comparison in C, plus O(depth * workers per node) dictionary work; depth is at most the number of
    distinct branch points on the path. `evict` and `remove_worker` are O(nodes the worker holds) plus
    O(log) heap work per evicted leaf.
    """

    def __init__(self, unit: int = 1) -> None:
        self.unit = unit
        #: Namespace -> the root of its tree (a root has no parent); roots with no children are pruned.
        self.roots: dict[str, _Node] = {}
        self._sizes: dict[str, int] = {}
        self._clock = 0

    def size(self, worker_id: str) -> int:
        """Symbols (tokens or characters) cached for the worker."""
        return self._sizes.get(worker_id, 0)

    def match(self, namespace: str, key: Key, worker_ids: Container[str]) -> tuple[int, list[str]]:
        """The longest prefix of `key` recorded in `namespace` for any of `worker_ids`: (length in
        symbols, holders).

        Holders are all listed workers that hold exactly that longest prefix; (0, []) when none holds
        even the first symbol. Does not touch access times.
        """
        unit = self.unit
        matched = 0
        holders: list[str] = []
        node = self.roots.get(namespace)
        if node is None:
            return 0, holders
        i = 0
        while i < len(key):
            child = node.children.get(key[i : i + unit])
            if child is None:
                break
            present = [w for w in child.workers if w in worker_ids]
            if not present:
                # Deeper nodes list a subset of this node's workers.
                break
            k = _common_prefix(child.label, key, i, unit)
            i += k
            matched, holders = i, present
            if k < len(child.label):
                break
            node = child
        return matched // unit, holders

    def matches(self, namespace: str, key: Key, worker_ids: Container[str]) -> dict[str, int]:
        """For each of `worker_ids` recorded in `namespace` as holding a prefix of `key`, the length in
        symbols of the longest such prefix; workers holding none are absent. Does not touch access times.

        One walk down the key's path, as `match`: O(L) element comparisons plus the workers listed on
        the nodes it passes.
        """
        unit = self.unit
        lengths: dict[str, int] = {}
        node = self.roots.get(namespace)
        if node is None:
            return lengths
        i = 0
        while i < len(key):
            child = node.children.get(key[i : i + unit])
            if child is None:
                break
            present = [w for w in child.workers if w in worker_ids]
            if not present:
                break  # deeper nodes list a subset of this node's workers
            k = _common_prefix(child.label, key, i, unit)
            i += k
            for worker_id in present:
                lengths[worker_id] = i // unit
            if k < len(child.label):
                break
            node = child
        return lengths

    def insert(self, namespace: str, key: Key, worker_id: str) -> None:
        """Record that `worker_id` was sent `key` in `namespace`, stamping every node on its path as just
        used."""
        unit = self.unit
        self._clock += 1
        now = self._clock
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = _Node(label="", parent=None, workers={})
        i = 0
        added = 0
        while i < len(key):
            first = key[i : i + unit]
            child = node.children.get(first)
            if child is None:
                node.children[first] = _Node(key[i:], node, {worker_id: now})
                added += len(key) - i
                break
            k = _common_prefix(child.label, key, i, unit)
            if k < len(child.label):
                # Split the edge: the shared part becomes a node held by everyone who held the edge.
                mid = _Node(child.label[:k], node, dict(child.workers))
                child.label = child.label[k:]
                child.parent = mid
                mid.children[child.label[:unit]] = child
                node.children[first] = mid
                child = mid
            if worker_id not in child.workers:
                added += k
            child.workers[worker_id] = now
            i += k
            node = child
        self._sizes[worker_id] = self._sizes.get(worker_id, 0) + added // unit

    def evict(self, worker_id: str, target: int) -> None:
        """Drop the worker's least recently used leaves, in any namespace, until it holds at most
        `target` symbols.

        Nodes no worker holds any more are deleted; a parent whose last child for this worker went
        becomes a leaf candidate itself.
        """
        if self.size(worker_id) <= target:
            return
        tie = itertools.count()
        heap: list[tuple[int, int, _Node]] = []
        # Children of each node that the worker holds, so a parent is known to become a leaf in O(1)
        # when its last such child goes (a shared prefix node may have thousands of children).
        held_children: dict[_Node, int] = {}
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            held = 0
            for child in node.children.values():
                if worker_id in child.workers:
                    held += 1
                    stack.append(child)
            held_children[node] = held
            if not held and node.parent is not None:
                heap.append((node.workers[worker_id], next(tie), node))
        heapq.heapify(heap)
        size = self._sizes[worker_id]
        while size > target and heap:
            _, _, node = heapq.heappop(heap)
            size -= self._drop(node, worker_id)
            parent = node.parent
            if parent is None or parent.parent is None:
                continue  # a root is never evicted, only pruned once empty
            held_children[parent] -= 1
            if not held_children[parent]:
                heapq.heappush(heap, (parent.workers[worker_id], next(tie), parent))
        self._sizes[worker_id] = size
        self._prune_roots()

    def remove_worker(self, worker_id: str) -> None:
        """Forget everything cached for the worker, deleting nodes that no other worker holds."""
        stack = list(self.roots.values())
        held: list[_Node] = []
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if worker_id in child.workers:
                    held.append(child)
                    stack.append(child)
        # Children before parents, so a parent is emptied only after its subtree.
        for node in reversed(held):
            self._drop(node, worker_id)
        self._sizes.pop(worker_id, None)
        self._prune_roots()

    def node_count(self) -> int:
        """Nodes below the roots."""
        count = 0
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count

    def _drop(self, node: _Node, worker_id: str) -> int:
        """Remove the worker from a node it holds as a leaf; returns the symbols freed."""
        del node.workers[worker_id]
        if not node.workers and node.parent is not None:
            # No worker left means no child is held either, so the whole node goes.
            del node.parent.children[node.label[: self.unit]]
        return len(node.label) // self.unit

    def _prune_roots(self) -> None:
        """Forget namespaces whose every entry was dropped, so roots are bounded by live namespaces."""
        self.roots = {namespace: root for namespace, root in self.roots.items() if root.children}


class RoutedPrompts:
    """What a cache-aware policy sent where, per tenant: the approximate `PrefixTree` of the prompts it
    routed and the `prompt_cache_key` map. `cache_aware` decides on it alone; `kv_aware` falls back to
    it for a worker whose engine publishes no KV events, and answers the inspector from it.

    `cache_key="tokens"` keys the tree on the prompt's token ids; `"selection-text"` on the characters
    of the last user message. Each worker's share of the tree is bounded by `max_tree_size` symbols
    (prompts longer than that are recorded truncated; least recently used leaves go first). The key map
    holds at most `max_cache_keys` keys, least recently used first out. Both are looked up and written
    in the request's tenant namespace only (`RoutingRequest.tenant`).
    """

    def __init__(
        self, *, cache_key: CacheKey = "tokens", max_tree_size: int = 2**20, max_cache_keys: int = 100_000
    ) -> None:
        if max_tree_size < 1:
            raise ValueError("max_tree_size must be at least 1")
        if cache_key not in ("tokens", "selection-text"):
            raise ValueError(f"cache_key must be 'tokens' or 'selection-text', not {cache_key!r}")
        self.cache_key: CacheKey = cache_key
        self.max_tree_size = max_tree_size
        self.max_cache_keys = max_cache_keys
        self.tree = PrefixTree(unit=_ID_BYTES if cache_key == "tokens" else 1)
        #: `tenant_key(tenant, prompt_cache_key)` -> id of the worker it was last sent to (least recently
        #: used first).
        self.keys: OrderedDict[str, str] = OrderedDict()

    def key(self, request: RoutingRequest) -> Key:
        """The request's key in the tree: its packed token ids, or its last user message."""
        if self.cache_key == "selection-text":
            return request.selection_text
        return pack_token_ids(request.input_ids)

    def symbols(self, key: Key) -> int:
        """The key's length in tokens (characters in selection-text mode)."""
        return len(key) // self.tree.unit

    def keyed_worker(self, candidates: Sequence[Worker], request: RoutingRequest) -> Worker | None:
        """The candidate the request's tenant last sent its `prompt_cache_key` to; None without a key,
        for a key not seen, or when that worker is not among `candidates`."""
        cache_key = request.cache_key
        worker_id = self.keys.get(tenant_key(request.tenant, cache_key)) if cache_key else None
        if worker_id is None:
            return None
        return next((w for w in candidates if w.id == worker_id), None)

    def record(self, request: RoutingRequest, key: Key, worker_id: str) -> None:
        """Record that the request (whose tree key is `key`) was sent to `worker_id`: its prefix in the
        tree, its `prompt_cache_key` in the map."""
        if key:
            unit = self.tree.unit
            self.tree.insert(request.tenant, key[: self.max_tree_size * unit], worker_id)
            if self.tree.size(worker_id) > self.max_tree_size:
                self.tree.evict(worker_id, int(self.max_tree_size * _EVICT_TO))
        if request.cache_key:
            scoped = tenant_key(request.tenant, request.cache_key)
            self.keys[scoped] = worker_id
            self.keys.move_to_end(scoped)
            if len(self.keys) > self.max_cache_keys:
                self.keys.popitem(last=False)

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker's prefixes; keys naming it stay and simply stop matching a candidate."""
        self.tree.remove_worker(worker_id)


class CacheAwarePolicy(RoutingPolicy):
    """Routes to the worker with the longest cached prefix, unless load is skewed or the match is short.

    For each request, among the available workers:

    1. If load is imbalanced (max in_flight - min in_flight > `balance_abs_threshold` and
       max > min * `balance_rel_threshold`), the least loaded worker wins.
    2. Otherwise the worker holding the longest prefix of the prompt wins (the least loaded among
       equals) when that prefix is at least `cache_threshold` of the prompt. The threshold is what stops
       the Harmony system prefix, which every prompt shares, from pinning all traffic to one worker;
       a prompt whose shared part is above the threshold (say 80 shared tokens of 100) does follow it.
    3. Otherwise the worker with the fewest cached tokens wins (then fewest in flight), spreading
       new prefixes.

    Prefixes and keys are looked up and recorded in the request's tenant namespace only
    (`RoutingRequest.tenant`): "the longest prefix" is the longest among that tenant's own prompts.

    A request with a `prompt_cache_key` (`RoutingRequest.cache_key`) goes, unless load is imbalanced
    (rule 1), to the worker the same tenant last sent that key to while it is available: the client
    promised that requests sharing the key share their prefix, which holds even when the prefix is below
    the threshold (a new agent session whose first turns are mostly the shared system prompt). The key
    map is bounded (`max_cache_keys`, least recently used first).

    The prompt is then recorded under the chosen worker (`RoutedPrompts`: `cache_key`, `max_tree_size`).
    Selecting costs O(prompt length) with small constants (see `PrefixTree`).

    This policy reads only its own record, never the engines' KV events: `kv_aware` is the policy that
    routes on them.
    """

    name = "cache_aware"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 2**20,
        cache_key: CacheKey = "tokens",
        max_cache_keys: int = 100_000,
    ) -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be between 0 and 1")
        check_balance_thresholds(balance_abs_threshold, balance_rel_threshold)
        self._routed = RoutedPrompts(
            cache_key=cache_key, max_tree_size=max_tree_size, max_cache_keys=max_cache_keys
        )
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.cache_key: CacheKey = cache_key
        self.max_cache_keys = max_cache_keys

    def cached_tokens(self, worker: Worker) -> int:
        """Tokens (characters in selection-text mode) the tree records for the worker."""
        return self._routed.tree.size(worker.id)

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        candidates = available_workers(workers, request)
        key = self._routed.key(request)
        chosen = self._by_cache_key(candidates, request) or self._choose(candidates, request.tenant, key)
        self._routed.record(request, key, chosen.id)
        return chosen

    def peek(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        candidates = available_workers(workers, request)
        return self._by_cache_key(candidates, request) or self._choose(
            candidates, request.tenant, self._routed.key(request)
        )

    def match_length(self, workers: Sequence[Worker], request: RoutingRequest) -> int | None:
        """The longest prefix of the request's key any of `workers` is recorded to hold for the
        request's tenant, in tokens (characters with `cache_key="selection-text"`); reads the tree
        without touching it."""
        key = self._routed.key(request)
        if not key:
            return 0
        return self._routed.tree.match(request.tenant, key, {w.id for w in workers})[0]

    def _by_cache_key(self, candidates: list[Worker], request: RoutingRequest) -> Worker | None:
        worker = self._routed.keyed_worker(candidates, request)
        if worker is None:
            return None
        loads = [w.in_flight for w in candidates]
        if imbalanced(max(loads), min(loads), self.balance_abs_threshold, self.balance_rel_threshold):
            return None  # rule 1 first: a skewed load is balanced even against the key
        return worker

    def on_worker_removed(self, worker: Worker) -> None:
        self._routed.remove_worker(worker.id)

    def _choose(self, candidates: list[Worker], tenant: str, key: Key) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        tree = self._routed.tree
        least = min(candidates, key=lambda w: w.in_flight)
        most = max(w.in_flight for w in candidates)
        if imbalanced(most, least.in_flight, self.balance_abs_threshold, self.balance_rel_threshold):
            return least
        if key:
            by_id = {w.id: w for w in candidates}
            matched, holders = tree.match(tenant, key, by_id)
            if holders and matched >= self.cache_threshold * self._routed.symbols(key):
                return min((by_id[h] for h in holders), key=lambda w: w.in_flight)
        return min(candidates, key=lambda w: (tree.size(w.id), w.in_flight))


def check_balance_thresholds(balance_abs_threshold: int, balance_rel_threshold: float) -> None:
    """Raises ValueError unless `balance_abs_threshold` >= 0 and `balance_rel_threshold` >= 1."""
    if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
        raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")


def imbalanced(load: float, least: float, balance_abs_threshold: int, balance_rel_threshold: float) -> bool:
    """Whether `load` is skewed against the least loaded worker's `least`: more than
    `balance_abs_threshold` above it and more than `balance_rel_threshold` times it. Both margins must
    clear, so neither steady-state noise at low load nor a deep queue at high load is misread."""
    return load - least > balance_abs_threshold and load > least * balance_rel_threshold
