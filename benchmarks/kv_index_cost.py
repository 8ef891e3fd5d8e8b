"""What following the engines' KV events costs the gateway: proto conversion plus the prefix index, per
event, and what matching a long prompt against every worker's index costs.

Four simulated engines (block size 16, a device cache of `--capacity` blocks each) serve agentic
sessions: each step extends a session's chain by 1-8 blocks or starts a new one from a shared system
prompt, and an engine over its capacity evicts its least recently used leaf blocks, publishing removals
of 1-4 blocks. Their events go out in `KvEventBatch` messages of 1-4 events, serialized as on the wire.
The benchmark parses them (what grpc does on the event loop before the gateway sees a message; reported
apart), converts them (`engines.kv_wire.kv_batch`) and applies them (`routing.kv_index.KvIndex`), and
reports microseconds per event and the share of one core that 20,000 events a second would take.

    PYTHONPATH=src python benchmarks/kv_index_cost.py [--events 200000] [--capacity 20000]

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections import OrderedDict

from smg_grpc_proto.generated import common_pb2

from harmony_gateway.engines.base import EngineCapabilities
from harmony_gateway.engines.kv_wire import kv_batch
from harmony_gateway.routing.kv_index import KvIndex
from harmony_gateway.routing.kv_subscriptions import FeedConfig, WorkerFeed
from harmony_gateway.routing.workers import Worker

BLOCK = 16
WORKERS = 4
TARGET_EVENTS_PER_SECOND = 20_000
ROUNDS = 5


class _Engine:
    """What a feed asks of its worker's client before it streams: that it publishes KV events."""

    capabilities = EngineCapabilities(kv_events=True)


class SimEngine:
    """An engine's prefix cache at block level: chains of blocks, LRU eviction of leaf blocks."""

    def __init__(self, rng: random.Random, capacity: int, system_prompts: list[list[int]]) -> None:
        self.rng = rng
        self.capacity = capacity
        self.system_prompts = system_prompts
        self.next_hash = rng.getrandbits(40)
        # engine hash -> (parent hash or None, children count); leaves in LRU order
        self.blocks: dict[int, list[int | None]] = {}
        self.leaves: OrderedDict[int, None] = OrderedDict()
        self.sessions: list[int] = []  # the engine hash each session's chain ends at
        self.sequence = 0

    def _new_hash(self) -> int:
        self.next_hash += 1
        return (self.next_hash * 0x9E3779B97F4A7C15) % 2**63

    def store(self, parent: int | None, count: int) -> common_pb2.KvCacheEvent:
        blocks = []
        for _ in range(count):
            h = self._new_hash()
            tokens = [self.rng.randrange(200_000) for _ in range(BLOCK)]
            blocks.append(common_pb2.KvBlock(block_hash=h, token_ids=tokens, block_size=BLOCK))
            self.blocks[h] = [parent, 0]
            if parent is not None and parent in self.blocks:
                if self.blocks[parent][1] == 0:
                    self.leaves.pop(parent, None)
                self.blocks[parent][1] += 1  # type: ignore[operator]
            parent = h
        assert parent is not None
        self.leaves[parent] = None
        stored = common_pb2.KvBlocksStored(
            blocks=blocks, tier=common_pb2.KV_CACHE_TIER_DEVICE, locality=common_pb2.KV_CACHE_LOCALITY_LOCAL
        )
        if blocks and parent is not None:
            first_parent = self.blocks[blocks[0].block_hash][0]
            if first_parent is not None:
                stored.parent_block_hash = first_parent
        return common_pb2.KvCacheEvent(stored=stored)

    def step(self) -> list[common_pb2.KvCacheEvent]:
        events = []
        if self.sessions and self.rng.random() < 0.8:
            i = self.rng.randrange(len(self.sessions))
            tip = self.sessions[i]
            if tip not in self.blocks:
                tip = None  # evicted: the session starts over
            event = self.store(tip, self.rng.randint(1, 8))
            self.sessions[i] = event.stored.blocks[-1].block_hash
        else:
            event = self.store(None, self.rng.randint(1, 8))
            self.sessions.append(event.stored.blocks[-1].block_hash)
            if len(self.sessions) > 200:
                self.sessions.pop(0)
        events.append(event)
        while len(self.blocks) > self.capacity:
            victims = []
            for _ in range(self.rng.randint(1, 4)):
                if not self.leaves:
                    break
                victim, _ = self.leaves.popitem(last=False)
                parent, _children = self.blocks.pop(victim)
                victims.append(victim)
                if parent is not None and parent in self.blocks:
                    self.blocks[parent][1] -= 1  # type: ignore[operator]
                    if self.blocks[parent][1] == 0:
                        self.leaves[parent] = None
                        self.leaves.move_to_end(parent, last=False)
            events.append(common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(block_hashes=victims)))
        return events


def make_stream(rng: random.Random, total_events: int, capacity: int) -> list[tuple[int, bytes]]:
    system_prompts = [[rng.randrange(200_000) for _ in range(16 * rng.randint(200, 400))] for _ in range(4)]
    engines = [SimEngine(rng, capacity, system_prompts) for _ in range(WORKERS)]
    # Warm the caches up to capacity without recording.
    for engine in engines:
        while len(engine.blocks) < capacity:
            engine.step()
    stream: list[tuple[int, bytes]] = []
    pending: list[list[common_pb2.KvCacheEvent]] = [[] for _ in range(WORKERS)]
    events = 0
    while events < total_events:
        w = rng.randrange(WORKERS)
        engine = engines[w]
        pending[w].extend(engine.step())
        if len(pending[w]) >= rng.randint(1, 4):
            engine.sequence += 1
            batch = common_pb2.KvEventBatch(
                sequence_number=engine.sequence, timestamp=time.time(), events=pending[w]
            )
            batch.load.running_requests = 12
            batch.load.waiting_requests = 1
            batch.load.token_usage = 0.71
            batch.load.sample = engine.sequence
            stream.append((w, batch.SerializeToString()))
            events += len(pending[w])
            pending[w] = []
    return stream


def measure_events(stream: list[tuple[int, bytes]], capacity: int) -> None:
    """Each message as the gateway meets it: parsed (grpc's deserializer), converted and applied at
    once, so the conversion reads a message still in the cache. Parsing alone is timed apart, and what
    the gateway adds is the difference."""
    parse = common_pb2.KvEventBatch.FromString
    messages = [(w, parse(data)) for w, data in stream]
    events = sum(len(m.events) for _, m in messages)
    stores = sum(1 for _, m in messages for e in m.events if e.WhichOneof("data") == "stored")
    blocks = sum(
        len(e.stored.blocks) for _, m in messages for e in m.events if e.WhichOneof("data") == "stored"
    )
    groups: list[dict[int, bool]] = [{} for _ in range(WORKERS)]
    converted = [(w, kv_batch(m, groups[w])) for w, m in messages]
    del messages
    # The inputs stay out of the collector's way, as a gateway's start-up objects do (app.py freezes
    # them); what each round makes is collected as usual.
    gc.collect()
    gc.freeze()

    def parse_only() -> None:
        for _, data in stream:
            parse(data)

    def parse_convert_apply() -> list[KvIndex]:
        indexes = [KvIndex(max_blocks=capacity * 4) for _ in range(WORKERS)]
        groups: list[dict[int, bool]] = [{} for _ in range(WORKERS)]
        for w, data in stream:
            batch = kv_batch(parse(data), groups[w])
            indexes[w].apply(batch.events, batch.dp_rank or 0)
        return indexes

    def through_feeds() -> None:
        feeds = [
            WorkerFeed(Worker(url=f"grpc://w{w}:1", client=_Engine()), FeedConfig(max_blocks=capacity * 4))
            for w in range(WORKERS)
        ]  # type: ignore[arg-type]
        for w, data in stream:
            feeds[w].apply_batch(kv_batch(parse(data), groups[w]))

    def index_only() -> None:
        indexes = [KvIndex(max_blocks=capacity * 4) for _ in range(WORKERS)]
        for w, batch in converted:
            indexes[w].apply(batch.events, batch.dp_rank or 0)

    # Interleaved rounds; the fastest of each is the cost without the machine's other load.
    timings: dict[str, list[float]] = {"parse": [], "all": [], "index": [], "feeds": []}
    for _ in range(ROUNDS):
        for name, work in (
            ("parse", parse_only),
            ("all", parse_convert_apply),
            ("index", index_only),
            ("feeds", through_feeds),
        ):
            gc.collect()
            started = time.process_time()
            work()
            timings[name].append((time.process_time() - started) / events * 1e6)
    parsed, total, index = (min(timings[name]) for name in ("parse", "all", "index"))
    per_event = total - parsed
    indexes = parse_convert_apply()
    print(
        f"events: {events} in {len(stream)} batches ({stores} stores of {blocks / stores:.1f} blocks on average)"
    )
    print(
        f"index sizes: {[len(i) for i in indexes]} blocks; orphaned stores: {sum(i.counters.orphaned for i in indexes)}"
    )
    print(f"parse (grpc's deserializer, before the gateway sees a message): {parsed:.2f} us/event")
    print(f"index alone:                                     {index:.2f} us/event")
    print(f"conversion + index (what the gateway adds):      {per_event:.2f} us/event")
    share = per_event * TARGET_EVENTS_PER_SECOND / 1e6 * 100
    print(f"at {TARGET_EVENTS_PER_SECOND} events/s: {share:.1f} % of one core (target <= 10 %)")
    print(
        f"with parsing:                                    {total:.2f} us/event, {total * 2:.1f} % of one core"
    )
    feeds = min(timings["feeds"]) - parsed
    print(f"through the subscriber (cursors, load records, index): {feeds:.2f} us/event, {feeds * 2:.1f} %")
    medians = {name: sorted(values)[len(values) // 2] for name, values in timings.items()}
    print(f"(median rounds, parse included: {', '.join(f'{k} {v:.2f}' for k, v in medians.items())})")


def measure_match(rng: random.Random) -> None:
    prompt_tokens = 30_000
    base = [rng.randrange(200_000) for _ in range(prompt_tokens)]
    indexes = []
    for _ in range(WORKERS):
        index = KvIndex()
        parent = None
        for start in range(0, prompt_tokens - BLOCK + 1, BLOCK * 8):
            count = min(8, (prompt_tokens - start) // BLOCK)
            blocks = [
                common_pb2.KvBlock(
                    block_hash=rng.getrandbits(62),
                    token_ids=base[start + i * BLOCK : start + (i + 1) * BLOCK],
                )
                for i in range(count)
            ]
            stored = common_pb2.KvBlocksStored(blocks=blocks)
            if parent is not None:
                stored.parent_block_hash = parent
            index.apply(
                kv_batch(common_pb2.KvEventBatch(events=[common_pb2.KvCacheEvent(stored=stored)]), {}).events
            )
            parent = blocks[-1].block_hash
        indexes.append(index)
    rounds = 50
    started = time.process_time()
    for _ in range(rounds):
        prompt = list(base)  # a new prompt object each round: its hashes are computed again
        matched = [index.matched_tokens(prompt) for index in indexes]
    elapsed = (time.process_time() - started) / rounds
    assert matched == [prompt_tokens // BLOCK * BLOCK] * WORKERS, matched
    print(
        f"matched_tokens, {prompt_tokens}-token prompt held whole by {WORKERS} workers: {elapsed * 1e3:.2f} ms per prompt"
    )
    started = time.process_time()
    for _ in range(rounds):
        [index.matched_tokens(prompt) for index in indexes]  # the same object: its hashes are kept
    elapsed = (time.process_time() - started) / rounds
    print(f"matched_tokens, the same prompt object again (hashes reused): {elapsed * 1e3:.2f} ms per prompt")
    miss = [rng.randrange(200_000) for _ in range(prompt_tokens)]
    started = time.process_time()
    for _ in range(rounds):
        prompt = list(miss)
        [index.matched_tokens(prompt) for index in indexes]
    elapsed = (time.process_time() - started) / rounds
    print(f"matched_tokens, same prompt held by none: {elapsed * 1e3:.3f} ms per prompt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--capacity", type=int, default=20_000, help="device cache per engine, in blocks")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    stream = make_stream(rng, args.events, args.capacity)
    measure_events(stream, args.capacity)
    measure_match(rng)


if __name__ == "__main__":
    main()
