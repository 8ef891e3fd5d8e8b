"""The offline oracle: how much of the replayed prompts a router that knew every cache could have hit.

Input: the twins' notes (`twin.py`): every request's arrival time, prompt ids, planned output length and,
when it left, its output ids. The oracle replays the same requests, merged across workers in the order
they arrived (the order the gateways actually sent them), through as many instances of the twin's own
cache model (`harmony_gateway.sim.kv_cache.BlockCache`, same block size and capacity) as there are
workers, and routes each request to the cache holding its longest cached prefix:

- The prefix counts whole blocks, at most `(len - 1) // block_size` (the engine always computes the last
  token), as the twin reports `cached_tokens`.
- Blocks every prompt of the trace shares (the Harmony header and the start of the system message, the
  same for every request) do not count toward "longest": otherwise every new session would follow that
  header to whichever worker served first, and one worker would hold the whole trace.
- Ties (new sessions, whose prompt shares nothing beyond that header with any cache) go to the worker
  that was assigned the fewest requests so far, then to the lowest index.
- Each cache is kept as the twin keeps its own: admission pins the cached prefix and reserves room for
  the uncached prompt and the planned output (evicting unpinned leaves, least recently used first); the
  prompt's blocks are stored at arrival (the twin stores them after the prefill); on leaving, the blocks
  of prompt + output are stored and everything is unpinned. Unlike the twin, a request never waits for
  room (it is admitted over capacity), so the oracle never evicts more than the twin would: an upper
  bound on what routing alone can reach, with no load balancing at all.

The hit rate is cached / prompt tokens over every request that arrived after the replay started.
"""

from __future__ import annotations

import pickle
import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harmony_gateway.sim.kv_cache import Block, BlockCache, chain_keys


@dataclass
class TwinNotes:
    """What one twin recorded (`twin.py`)."""

    enters: list[tuple[float, int, int, array[int]]]
    leaves: list[tuple[float, int, array[int], int]]
    prompt_tokens: int
    cached_tokens: int
    requests: int
    evicted_blocks: int
    capacity_blocks: int
    block_size: int

    @classmethod
    def load(cls, path: Path) -> TwinNotes:
        data: dict[str, Any] = pickle.loads(path.read_bytes())
        return cls(**data)


@dataclass
class OracleResult:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    #: Distinct blocks of every prompt and output, in tokens: what caches would hold to miss nothing.
    working_set_tokens: int
    #: Hit rate with unbounded caches and perfect routing: every block seen before is a hit.
    unbounded_hit_rate: float
    #: Requests the oracle sent to each worker.
    assigned: list[int]
    #: The worker the oracle chose for each request, by (twin, request number) as the twins noted them.
    choices: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Held:
    worker: int
    ids: array[int]
    keys: list[int]
    pinned: list[Block]
    reserved: int


def _shared_blocks(prompts: list[list[int]]) -> int:
    """Blocks at the start of every prompt that are the same in all of them."""
    if not prompts:
        return 0
    first = prompts[0]
    shared = len(first)
    for keys in prompts[1:]:
        limit = min(shared, len(keys))
        index = 0
        while index < limit and keys[index] == first[index]:
            index += 1
        shared = index
    return shared


def run_oracle(notes: list[TwinNotes], *, since: float = 0.0) -> OracleResult:
    """Replay the requests that arrived at or after `since` (wall-clock) through one cache per worker."""
    if not notes:
        raise ValueError("no twin notes")
    size = notes[0].block_size
    capacity = notes[0].capacity_blocks
    # (time, kind, twin, number, payload): arrivals before departures at the same instant.
    events: list[tuple[float, int, int, int, Any]] = []
    for twin, note in enumerate(notes):
        numbers = set()
        for t, number, out_tokens, ids in note.enters:
            if t >= since:
                events.append((t, 0, twin, number, (out_tokens, ids)))
                numbers.add(number)
        for t, number, output, _cached in note.leaves:
            if number in numbers:
                events.append((t, 1, twin, number, output))
    events.sort(key=lambda event: (event[0], event[1]))

    prompt_keys: dict[tuple[int, int], list[int]] = {}
    for _t, kind, twin, number, payload in events:
        if kind == 0:
            ids = payload[1]
            prompt_keys[(twin, number)] = chain_keys(ids, size, len(ids) // size)
    shared = _shared_blocks(list(prompt_keys.values()))

    caches = [BlockCache(size, capacity, "sglang") for _ in notes]
    assigned = [0] * len(caches)
    choices: dict[tuple[int, int], int] = {}
    held: dict[tuple[int, int], _Held] = {}
    seen: set[int] = set()
    prompt_total = cached_total = unbounded_cached = 0
    for _t, kind, twin, number, payload in events:
        key = (twin, number)
        if kind == 0:
            out_tokens, ids = payload
            keys = prompt_keys.pop(key)
            usable = keys[: (len(ids) - 1) // size]
            matches = [cache.match(usable) for cache in caches]
            worker = min(range(len(caches)), key=lambda w: (-max(0, matches[w] - shared), assigned[w], w))
            assigned[worker] += 1
            choices[key] = worker
            cache = caches[worker]
            cached = matches[worker]
            pinned = cache.pin(keys[:cached])
            need = -(-(len(ids) + out_tokens) // size) - cached
            cache.make_room(need)
            computed = len(keys) - cached
            cache.reserved += need - computed
            cache.store(ids, keys, pinned, len(keys), copies=False)
            held[key] = _Held(worker, ids, keys, pinned, need - computed)
            prompt_total += len(ids)
            cached_total += cached * size
            run = 0
            while run < len(usable) and usable[run] in seen:
                run += 1
            unbounded_cached += run * size
            seen.update(keys)
        else:
            entry = held.pop(key, None)
            if entry is None:
                continue
            cache = caches[entry.worker]
            cache.reserved -= entry.reserved
            output: array[int] = payload
            sequence = [*entry.ids, *output]
            full = len(entry.keys)
            blocks = (len(sequence) - 1) // size
            if output and blocks > full and len(entry.pinned) == full:
                parent = entry.keys[-1] if entry.keys else 0
                keys = entry.keys + chain_keys(sequence, size, blocks - full, parent, full * size)
                cache.store(sequence, keys, entry.pinned, blocks, copies=False)
                seen.update(keys[full:])
            cache.unpin(entry.pinned)
    # Requests still held when the replay ended (failed turns) release nothing more: the result is read.
    return OracleResult(
        requests=sum(assigned),
        prompt_tokens=prompt_total,
        cached_tokens=cached_total,
        working_set_tokens=len(seen) * size,
        unbounded_hit_rate=unbounded_cached / prompt_total if prompt_total else 0.0,
        assigned=assigned,
        choices=choices,
    )


_MARK = re.compile(r"^ (\d+) turn (\d+)\]")


def session_turns(notes: list[TwinNotes], *, since: float = 0.0) -> dict[tuple[int, int], tuple[int, int]]:
    """(session, turn) of each request the twins noted at or after `since`, by (twin, request number),
    read from the marker the trace puts at the start of every turn's message (`[session N turn T]`),
    whichever gateway rendered the prompt: the last occurrence of its tokens is the current turn."""
    # lazy: the encoding loads the o200k tables (~50 MB), only when the analysis runs
    from harmony_gateway.harmony.encoding import get_encoding

    encoding = get_encoding()
    marker = encoding.encode("[session", allowed_special="all")
    first, width = marker[0], len(marker)
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for twin, note in enumerate(notes):
        for t, number, _out_tokens, ids in note.enters:
            if t < since:
                continue
            for start in range(len(ids) - width, -1, -1):
                if ids[start] == first and list(ids[start : start + width]) == marker:
                    text = encoding.decode(list(ids[start + width : start + width + 12]))
                    match = _MARK.match(text)
                    if match:
                        out[(twin, number)] = (int(match[1]), int(match[2]))
                    break
    return out


def moves(workers: dict[tuple[int, int], int], labels: dict[tuple[int, int], tuple[int, int]]) -> int:
    """Turns served by another worker than the same session's turn before (`workers`: the worker of each
    request, by the twins' (twin, request number))."""
    by_turn = {labels[key]: worker for key, worker in workers.items() if key in labels}
    return sum(
        1
        for (session, turn), worker in by_turn.items()
        if turn > 0 and (session, turn - 1) in by_turn and by_turn[(session, turn - 1)] != worker
    )
