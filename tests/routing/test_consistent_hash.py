from __future__ import annotations

from collections import Counter

from harmony_gateway.routing import ConsistentHashPolicy, RoutingRequest

from ._fakes import make_worker, make_workers


def keyed(key: str | None) -> RoutingRequest:
    return RoutingRequest(model="m", input_ids=[1, 2], routing_key=key)


KEYS = [f"session-{i}" for i in range(1000)]


def placement(policy: ConsistentHashPolicy, workers: list) -> dict[str, str]:
    return {k: policy.select(workers, keyed(k)).id for k in KEYS}


def test_pins_a_key_to_one_worker() -> None:
    policy = ConsistentHashPolicy()
    workers = make_workers(5)
    assert len({policy.select(workers, keyed("user-42")).id for _ in range(1000)}) == 1


def test_placement_does_not_depend_on_worker_order_or_instance() -> None:
    workers = make_workers(5)
    assert placement(ConsistentHashPolicy(), workers) == placement(ConsistentHashPolicy(), workers[::-1])


def test_spreads_keys_evenly() -> None:
    counts = Counter(placement(ConsistentHashPolicy(), make_workers(4)).values())
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert all(150 < c < 350 for c in counts.values()), counts


def test_removing_a_worker_moves_only_its_keys() -> None:
    policy = ConsistentHashPolicy()
    workers = make_workers(5)
    before = placement(policy, workers)
    gone = workers[2]
    policy.on_worker_removed(gone)
    after = placement(policy, [w for w in workers if w is not gone])
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == gone.id}
    assert len(moved) < 350  # ~1/5 expected


def test_unavailable_worker_hands_over_only_its_keys() -> None:
    policy = ConsistentHashPolicy()
    workers = make_workers(5)
    before = placement(policy, workers)
    workers[0].healthy = False
    after = placement(policy, workers)
    assert {k for k in KEYS if before[k] != after[k]} == {k for k in KEYS if before[k] == "w0"}
    workers[0].healthy = True
    assert placement(policy, workers) == before


def test_adding_a_worker_moves_a_minority_of_keys_to_it() -> None:
    policy = ConsistentHashPolicy()
    workers = make_workers(4)
    before = placement(policy, workers)
    after = placement(policy, [*workers, make_worker("new")])
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "new" for k in moved)
    assert 100 < len(moved) < 330  # ~1/5 expected


def test_without_a_key_goes_to_the_least_loaded() -> None:
    policy = ConsistentHashPolicy(seed=1)
    workers = [make_worker("a", in_flight=4), make_worker("b", in_flight=1), make_worker("c", in_flight=3)]
    assert {policy.select(workers, keyed(None)).id for _ in range(50)} == {"b"}


def test_placement_follows_worker_urls_not_process_local_ids() -> None:
    # Another process (or this one after a restart) numbers its workers differently; the URLs stay.
    here = make_workers(4)
    there = [make_worker(f"w{i}") for i in range(4)]
    for worker, other_id in zip(there, ("x9", "x3", "x7", "x1"), strict=True):
        worker.id = other_id
    policy_here, policy_there = ConsistentHashPolicy(), ConsistentHashPolicy()
    here_urls = {k: policy_here.select(here, keyed(k)).url for k in KEYS}
    assert {k: policy_there.select(there, keyed(k)).url for k in KEYS} == here_urls


def test_prompt_cache_key_wins_over_the_routing_key() -> None:
    from harmony_gateway.routing import RoutingRequest
    from harmony_gateway.routing.consistent_hash import ConsistentHashPolicy

    from ._fakes import make_workers

    policy = ConsistentHashPolicy(seed=1)
    workers = make_workers(8)
    chosen = {
        policy.select(workers, RoutingRequest("m", [1], routing_key=f"user-{i}", cache_key="session")).id
        for i in range(30)
    }
    assert len(chosen) == 1
    alone = policy.select(workers, RoutingRequest("m", [1], routing_key="session"))
    assert chosen == {alone.id}  # the same ring position as the key itself
