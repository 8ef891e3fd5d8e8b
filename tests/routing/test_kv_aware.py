"""kv_aware: the cost of each worker (prefill left after its cached prefix, queued prefill, decode load),
its spill rules, and its fallbacks, on real `Worker` objects with a small in-test prefix index."""

from __future__ import annotations

import random
import time

import pytest

from harmony_gateway.engines.kv_events import EngineLoad
from harmony_gateway.errors import NoHealthyWorker
from harmony_gateway.routing import KvAwarePolicy, RoutingRequest, Worker, create_policy

from ._fakes import BlockIndex, make_worker

rng = random.Random(2024)


def ids(n: int) -> list[int]:
    return [rng.randrange(200_000) for _ in range(n)]


def req(input_ids: list[int], *, tenant: str = "", cache_key: str | None = None) -> RoutingRequest:
    return RoutingRequest("gpt-oss-120b", input_ids, cache_key=cache_key, tenant=tenant)


def load(
    *,
    running: int = 0,
    waiting: int = 0,
    uncached: int | None = 0,
    usage: float = 0.1,
    active_usage: float | None = None,
    age_ms: int = 0,
    pending: int | None = None,
) -> EngineLoad:
    return EngineLoad(
        running_requests=running,
        waiting_requests=waiting,
        waiting_uncached_tokens=uncached,
        token_usage=usage,
        active_token_usage=active_usage,
        gen_throughput=0.0,
        max_running_requests=64,
        age_ms=age_ms,
        sample=1,
        load_only=True,
        prefill_pending_tokens=pending,
    )


def pushed(worker: Worker, record: EngineLoad, *, ago: float = 0.0) -> Worker:
    worker.engine_load = record
    worker.engine_load_at = time.monotonic() - ago
    return worker


def indexed(name: str, index: BlockIndex | None = None) -> Worker:
    worker = make_worker(name)
    worker.kv_index = index if index is not None else BlockIndex()
    return pushed(worker, load())


def test_a_prefix_held_only_on_b_goes_to_b() -> None:
    """Never routed by this policy, announced only by B's engine: B, wherever it is listed."""
    prompt = ids(400)
    a, b = indexed("a"), indexed("b", BlockIndex().store(prompt[:360]))
    policy = KvAwarePolicy()
    assert policy.select([a, b], req(prompt)) is b
    policy.on_request_done(b, None)
    assert policy.select([b, a], req(prompt)) is b
    score = {s.worker.id: s for s in policy.scores([a, b], req(prompt))}
    assert (score["a"].cached_tokens, score["b"].cached_tokens) == (0, 360)
    assert score["b"].cached_from == "index"


def test_the_cost_is_prefill_left_plus_queued_prefill_plus_decode_load() -> None:
    prompt = ids(100)
    b = pushed(indexed("b", BlockIndex().store(prompt[:40])), load(running=3, waiting=2, uncached=700))
    policy = KvAwarePolicy(overlap_weight=2.0, decode_weight=10.0)
    (score,) = policy.scores([b], req(prompt))
    assert (score.cached_tokens, score.queued_tokens, score.active) == (40, 700, 5)
    assert score.cost == 2.0 * (100 - 40 + 0.25 * 700) + 10.0 * 5  # the default queue weight
    assert score.spill is None


def test_heavy_queued_prefill_on_b_spills_to_a() -> None:
    prompt = ids(400)
    a, b = indexed("a"), indexed("b", BlockIndex().store(prompt))
    pushed(b, load(running=2, waiting=6, uncached=50_000))
    assert KvAwarePolicy().select([a, b], req(prompt)) is a


def test_the_queue_weight_sets_how_much_a_queue_outweighs_a_held_prefix() -> None:
    """A session's home worker holds most of its prompt but has prefill queued; an idle worker holds
    none. At queue weight 1 the queue outweighs the held prefix and the turn leaves its cache; at a
    lower weight it waits at home."""
    prompt = ids(3000)
    home, idle = indexed("home", BlockIndex().store(prompt[:2800])), indexed("idle")
    pushed(home, load(running=1, waiting=1, uncached=3000))
    pushed(idle, load(running=1))
    assert KvAwarePolicy(queue_weight=1.0).select([home, idle], req(prompt)) is idle
    assert KvAwarePolicy(queue_weight=0.25).select([home, idle], req(prompt)) is home
    (score,) = KvAwarePolicy(queue_weight=0.25).scores([home], req(prompt))
    assert score.cost == (3000 - 2800 + 0.25 * 3000) + 1024.0 * 2


def test_many_running_requests_on_b_spill_to_a() -> None:
    prompt = ids(400)
    a, b = indexed("a"), indexed("b", BlockIndex().store(prompt))
    pushed(b, load(running=8))
    # Eight more requests in B's batch outweigh 400 tokens of prefill at the default decode weight ...
    assert KvAwarePolicy().select([a, b], req(prompt)) is a
    # ... and a prompt whose cached part is long enough is worth them.
    long_prompt = ids(20_000)
    b.kv_index = BlockIndex().store(long_prompt)
    assert KvAwarePolicy().select([a, b], req(long_prompt)) is b


def test_load_imbalance_leaves_affinity_however_long_the_prefix() -> None:
    long_prompt = ids(100_000)
    a, b = indexed("a"), indexed("b", BlockIndex().store(long_prompt))
    pushed(a, load(running=10))
    pushed(b, load(running=50))  # 40 above a (> 32) and 5x its load (> 1.5x)
    policy = KvAwarePolicy()
    assert policy.select([a, b], req(long_prompt)) is a
    assert {s.worker.id: s.spill for s in policy.scores([a, b], req(long_prompt))} == {
        "a": None,
        "b": "imbalance",
    }
    pushed(b, load(running=40))  # 30 above: within the band, the cache wins
    assert KvAwarePolicy().select([a, b], req(long_prompt)) is b


def test_kv_pressure_spills() -> None:
    prompt = ids(2000)
    a, b = indexed("a"), indexed("b", BlockIndex().store(prompt))
    pushed(b, load(usage=0.5, active_usage=0.95))
    policy = KvAwarePolicy()
    assert policy.select([a, b], req(prompt)) is a
    assert {s.worker.id: s.spill for s in policy.scores([a, b], req(prompt))}["b"] == "kv_pressure"
    # Without the non-evictable share the engine's token usage is read.
    pushed(b, load(usage=0.97))
    assert KvAwarePolicy().select([a, b], req(prompt)) is a
    # The threshold is a knob; 1.0 turns the rule off.
    assert KvAwarePolicy(kv_pressure_threshold=1.0).select([a, b], req(prompt)) is b
    # When every worker is under pressure, the cost decides among them all.
    pushed(a, load(usage=0.99))
    assert KvAwarePolicy().select([a, b], req(prompt)) is b


def test_stale_loads_are_ignored() -> None:
    prompt = ids(400)
    a, b = indexed("a"), indexed("b", BlockIndex().store(prompt))
    heavy = load(running=2, waiting=6, uncached=50_000, usage=0.99)
    pushed(b, heavy, ago=60.0)
    policy = KvAwarePolicy(load_max_age=5.0)
    assert policy.select([a, b], req(prompt)) is b
    score = {s.worker.id: s for s in policy.scores([a, b], req(prompt))}["b"]
    assert (score.load_from, score.queued_tokens, score.kv_usage) == ("in_flight", 0, None)
    # The record's own age counts too: a sample the servicer read a minute ago is a minute old.
    pushed(b, heavy._replace(age_ms=60_000))
    assert policy.select([a, b], req(prompt)) is b
    # A stale record leaves the gateway's own count: many requests in flight there spill.
    b.in_flight = 8
    assert policy.select([a, b], req(prompt)) is a


def test_the_engine_count_is_never_below_what_the_gateway_has_in_flight() -> None:
    b = pushed(indexed("b"), load(running=1))
    b.in_flight = 6
    (score,) = KvAwarePolicy().scores([b], req(ids(10)))
    assert (score.load_from, score.active) == ("engine", 6)


def test_unknown_queued_tokens_are_estimated() -> None:
    prompt = ids(100)
    b = indexed("b")
    policy = KvAwarePolicy()
    pushed(b, load(waiting=3, uncached=None, pending=900))
    assert policy.scores([b], req(prompt))[0].queued_tokens == 900
    pushed(b, load(waiting=3, uncached=None, pending=None))
    assert policy.scores([b], req(prompt))[0].queued_tokens == 300  # each waiting request like this one


def test_what_was_sent_since_the_last_record_counts() -> None:
    """Pushed loads lag the requests just sent: without counting them, every request until the next
    record would pile onto the worker that looked idlest."""
    a, b = indexed("a"), indexed("b")
    policy = KvAwarePolicy()
    first = policy.select([a, b], req(ids(1000)))
    second = policy.select([a, b], req(ids(1000)))
    assert {first.id, second.id} == {"a", "b"}
    score = {s.worker.id: s for s in policy.scores([a, b], req(ids(10)))}[first.id]
    assert (score.active, score.queued_tokens) == (1, 1000)
    policy.on_request_done(first, None)  # a finished request is no longer waiting to be prefilled
    score = {s.worker.id: s for s in policy.scores([a, b], req(ids(10)))}[first.id]
    assert (score.active, score.queued_tokens) == (0, 0)
    policy.select([first], req(ids(500)))
    pushed(first, load())  # a new record replaces the estimate
    score = {s.worker.id: s for s in policy.scores([a, b], req(ids(10)))}[first.id]
    assert (score.active, score.queued_tokens) == (0, 0)


def test_a_request_the_record_counts_stops_counting_when_it_finishes() -> None:
    """A record comes a scheduler tick after a change: the request it shows running that has finished
    since no longer weighs on its worker, so a sequential agent's next turn finds its cache idle."""
    a, b = indexed("a"), indexed("b")
    pushed(a, load(running=2))
    policy = KvAwarePolicy()
    active = lambda: {s.worker.id: s for s in policy.scores([a, b], req(ids(10)))}["a"].active  # noqa: E731
    assert active() == 2
    policy.on_request_done(a, None)
    assert active() == 1
    policy.on_request_done(a, None)
    policy.on_request_done(a, None)  # more than it counted: never below nothing
    assert active() == 0
    pushed(a, load(running=1))  # the next record is the truth again
    assert active() == 1


def test_an_incomplete_index_falls_back_to_the_record() -> None:
    prompt = ids(400)
    a = indexed("a")
    b = indexed("b", BlockIndex(complete=False))
    policy = KvAwarePolicy()
    a.healthy = False
    assert policy.select([a, b], req(prompt)) is b  # recorded under b
    policy.on_request_done(b, None)
    a.healthy = True
    b_index = b.kv_index
    assert isinstance(b_index, BlockIndex)
    assert policy.select([a, b], req(prompt)) is b
    assert b_index.lookups == 0  # a partially known index is not read
    score = {s.worker.id: s for s in policy.scores([a, b], req(prompt))}["b"]
    assert (score.cached_tokens, score.cached_from) == (400, "record")
    # Once the index is whole again it is the truth: the engine evicted the prompt, so b holds nothing
    # and the record does not count.
    b_index.complete = True
    score = {s.worker.id: s for s in policy.scores([a, b], req(prompt))}["b"]
    assert (score.cached_tokens, score.cached_from) == (0, "index")


def test_workers_without_an_index_use_the_record() -> None:
    a, b = make_worker("a"), make_worker("b")
    policy = KvAwarePolicy()
    conversation = ids(300)
    home = policy.select([a, b], req(conversation))
    for _ in range(5):
        conversation += ids(50)
        assert policy.select([a, b], req(conversation)) is home
    other = policy.select([a, b], req(ids(300)))
    assert other is not home  # a new prefix goes where fewer tokens were sent
    assert {s.cached_from for s in policy.scores([a, b], req(conversation))} == {"record"}


def test_a_mixed_fleet_compares_index_and_record_workers() -> None:
    prompt = ids(800)
    indexed_worker = indexed("a", BlockIndex().store(prompt[:200]))
    plain = make_worker("b")
    policy = KvAwarePolicy()
    indexed_worker.healthy = False
    assert policy.select([indexed_worker, plain], req(prompt)) is plain
    indexed_worker.healthy = True
    assert policy.select([indexed_worker, plain], req(prompt)) is plain  # 800 recorded beats 200 held


def test_wedged_and_unavailable_workers_are_excluded() -> None:
    prompt = ids(400)
    a, b = indexed("a"), indexed("b", BlockIndex().store(prompt))
    policy = KvAwarePolicy()
    b.wedged = True
    assert policy.select([a, b], req(prompt)) is a
    b.wedged, b.healthy = False, False
    assert policy.select([a, b], req(prompt)) is a
    assert [s.worker.id for s in policy.scores([a, b], req(prompt))] == ["a"]
    a.healthy = False
    with pytest.raises(NoHealthyWorker):
        policy.select([a, b], req(prompt))


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_peek_is_select_without_side_effects(temperature: float) -> None:
    def fleet() -> list[Worker]:
        workers = [indexed(f"w{i}") for i in range(3)] + [make_worker("plain")]
        return workers

    peeking, plain = (KvAwarePolicy(temperature=temperature, seed=5) for _ in range(2))
    peek_fleet, plain_fleet = fleet(), fleet()
    system = ids(64)
    for i in range(150):
        prompt = system + ids(rng.randrange(1, 200))
        if i % 5 == 0:
            prompt = system + ids(8)
        for workers in (peek_fleet, plain_fleet):
            index = workers[i % 3].kv_index
            assert isinstance(index, BlockIndex)
            if i % 7 == 0:
                index.store(prompt)
            pushed(workers[(i + 1) % 3], load(running=i % 4, uncached=(i % 3) * 100))
            workers[3].in_flight = i % 2
        request = req(prompt, cache_key=f"k{i % 6}" if i % 2 else None)
        peeked = [peeking.peek(peek_fleet, request).id for _ in range(2)]
        chosen = peeking.select(peek_fleet, request).id
        assert peeked == [chosen, chosen]
        assert plain.select(plain_fleet, request).id == chosen


def test_match_length_reveals_only_the_tenants_own_record() -> None:
    """The engines' caches hold every tenant's prompts; what the inspector tells a tenant comes from
    that tenant's own record alone, so no tenant can probe whether another's prompt is cached."""
    secret = ids(400)
    a, b = indexed("a", BlockIndex().store(secret)), indexed("b", BlockIndex().store(secret))
    policy = KvAwarePolicy()
    assert policy.match_length([a, b], req(secret, tenant="tenant-b")) == 0
    assert policy.match_length([a, b], req(secret, tenant="tenant-a")) == 0  # not routed by us yet
    chosen = policy.select([a, b], req(secret, tenant="tenant-a"))
    assert policy.match_length([a, b], req(secret, tenant="tenant-a")) == 400
    assert policy.match_length([a, b], req(secret[:100], tenant="tenant-b")) == 0
    # Selecting does read the engines' indexes for every tenant: that is the point of the policy.
    assert policy.peek([a, b], req(secret, tenant="tenant-b")) in (a, b)
    assert chosen in (a, b)


def test_prompt_cache_key_sticks_and_yields_to_spills() -> None:
    a, b = indexed("a"), indexed("b")
    policy = KvAwarePolicy()
    home = policy.select([a, b], req(ids(50), cache_key="session"))
    away = b if home is a else a
    for _ in range(5):
        assert policy.select([a, b], req(ids(50), cache_key="session")) is home
    # The key beats a prefix another worker holds: the client promised its turns share a prefix.
    shared = ids(200)
    away.kv_index = BlockIndex().store(shared)
    assert policy.select([a, b], req(shared + ids(10), cache_key="session")) is home
    # Another tenant's use of the same key string is a key of its own.
    assert policy.peek([a, b], req(ids(50), cache_key="session", tenant="other")) is away
    # Under KV pressure the key lets go ...
    pushed(home, load(usage=0.99))
    assert policy.peek([a, b], req(ids(50), cache_key="session")) is away
    # ... and under imbalance.
    pushed(home, load(running=60))
    pushed(away, load(running=2))
    assert policy.peek([a, b], req(ids(50), cache_key="session")) is away
    pushed(home, load())
    home.healthy = False
    assert policy.peek([a, b], req(ids(50), cache_key="session")) is away


def test_ties_break_on_load_then_on_what_was_sent_then_on_order() -> None:
    a, b, c = make_worker("a"), make_worker("b"), make_worker("c")
    policy = KvAwarePolicy(decode_weight=0.0)
    a.in_flight = 1
    assert policy.peek([a, b, c], req(ids(10))) is b  # equal cost, b and c less loaded, b first
    policy.select([b], req(ids(30)))
    assert policy.peek([a, b, c], req(ids(10))) is c  # b was sent more tokens


def test_temperature_spreads_near_ties_and_is_reproducible() -> None:
    def placements(seed: int) -> list[str]:
        policy = KvAwarePolicy(temperature=1.0, seed=seed)
        workers = [indexed(f"w{i}") for i in range(3)]
        return [policy.peek(workers, req(ids(10))).id for _ in range(1)] + [
            policy.select(workers, req(ids(10))).id for _ in range(60)
        ]

    first = placements(11)
    assert len(set(first)) == 3
    assert placements(11) == first


def test_a_removed_worker_is_forgotten() -> None:
    a, b = make_worker("a"), make_worker("b")
    policy = KvAwarePolicy()
    prompt = ids(100)
    home = policy.select([a, b], req(prompt, cache_key="k"))
    policy.on_worker_removed(home)
    assert policy.match_length([a, b], req(prompt)) == 0


def test_registered_and_configurable() -> None:
    policy = create_policy(
        "kv_aware",
        overlap_weight=0.5,
        decode_weight=64.0,
        load_max_age=1.5,
        kv_pressure_threshold=0.8,
        balance_abs_threshold=4,
        balance_rel_threshold=2.0,
        temperature=0.2,
    )
    assert isinstance(policy, KvAwarePolicy)
    assert (policy.overlap_weight, policy.decode_weight, policy.load_max_age) == (0.5, 64.0, 1.5)
    assert (policy.kv_pressure_threshold, policy.temperature) == (0.8, 0.2)
    assert (policy.balance_abs_threshold, policy.balance_rel_threshold) == (4, 2.0)


@pytest.mark.parametrize(
    ("option", "fragment"),
    [
        ({"overlap_weight": -1.0}, "overlap_weight"),
        ({"decode_weight": -1.0}, "decode_weight"),
        ({"load_max_age": 0.0}, "load_max_age"),
        ({"kv_pressure_threshold": 1.5}, "kv_pressure_threshold"),
        ({"temperature": -0.1}, "temperature"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
    ],
)
def test_invalid_options_are_rejected(option: dict[str, float], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        KvAwarePolicy(**option)  # type: ignore[arg-type]
