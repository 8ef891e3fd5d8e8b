from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from harmony_gateway.routing import CacheAwarePolicy, RoutingRequest, create_policy
from harmony_gateway.routing.cache_aware import PrefixTree, _Node, pack_token_ids
from harmony_gateway.routing.policy import tenant_key

from ._fakes import make_worker, make_workers

rng = random.Random(1234)


def ids(n: int) -> list[int]:
    return [rng.randrange(200_000) for _ in range(n)]


def req(input_ids: list[int], text: str = "") -> RoutingRequest:
    return RoutingRequest(model="gpt-oss-120b", input_ids=input_ids, selection_text=text)


def held_sizes(tree: PrefixTree) -> Counter[str]:
    """Recount every worker's cached symbols by walking the tree, checking the ancestor invariant."""
    sizes: Counter[str] = Counter()
    stack: list[_Node] = list(tree.roots.values())
    while stack:
        node = stack.pop()
        for child in node.children.values():
            assert child.workers, "empty nodes are deleted"
            if node.parent is not None:
                assert child.workers.keys() <= node.workers.keys()
            for w in child.workers:
                sizes[w] += len(child.label) // tree.unit
            stack.append(child)
    return sizes


def test_repeated_prompts_return_to_their_first_worker() -> None:
    policy = CacheAwarePolicy()
    workers = make_workers(4)
    system = ids(1000)  # the Harmony system + developer prefix every prompt shares
    prompts = [system + ids(3000) for _ in range(8)]
    first = [policy.select(workers, req(p)).id for p in prompts]
    assert len(set(first)) == 4  # new prompts spread: 1000/4000 shared is below the threshold
    order = [i for i in range(8) for _ in range(3)]
    random.Random(5).shuffle(order)
    for i in order:
        assert policy.select(workers, req(prompts[i])).id == first[i]


def test_growing_conversation_sticks_to_its_worker() -> None:
    policy = CacheAwarePolicy()
    workers = make_workers(3)
    for _ in range(3):  # warm other workers with unrelated traffic
        policy.select(workers, req(ids(500)))
    conversation = ids(400)
    home = policy.select(workers, req(conversation)).id
    for _ in range(5):
        conversation = conversation + ids(150)
        assert policy.select(workers, req(conversation)).id == home


def test_short_shared_system_prefix_does_not_pin_traffic() -> None:
    policy = CacheAwarePolicy()
    workers = make_workers(4)
    system = ids(80)
    counts = Counter(policy.select(workers, req(system + ids(120))).id for _ in range(40))
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert max(counts.values()) - min(counts.values()) <= 2


def test_match_above_the_threshold_follows_the_cache() -> None:
    # 80 shared ids then 20 distinct: an 80% match, above the default 0.5, so traffic follows the
    # cache; raising the threshold spreads it.
    system = ids(80)
    prompts = [system + ids(20) for _ in range(40)]
    workers = make_workers(4)
    default = CacheAwarePolicy()
    assert {default.select(workers, req(p)).id for p in prompts} == {"w0"}
    strict = CacheAwarePolicy(cache_threshold=0.9)
    assert {strict.select(workers, req(p)).id for p in prompts} == {"w0", "w1", "w2", "w3"}


def test_imbalance_routes_to_least_loaded_despite_cache() -> None:
    policy = CacheAwarePolicy()
    hot, cold = make_worker("hot"), make_worker("cold")
    prompt = ids(2000)
    cold.in_flight = 1  # so the first placement lands on hot
    assert policy.select([hot, cold], req(prompt)).id == "hot"
    hot.in_flight, cold.in_flight = 40, 0  # 40 - 0 > 32 and 40 > 0 * 1.5
    assert policy.select([hot, cold], req(prompt)).id == "cold"


def test_moderate_load_gap_keeps_cache_affinity() -> None:
    policy = CacheAwarePolicy()
    hot, cold = make_worker("hot"), make_worker("cold", in_flight=1)
    prompt = ids(2000)
    assert policy.select([hot, cold], req(prompt)).id == "hot"
    hot.in_flight, cold.in_flight = 30, 0  # gap 30 <= 32
    assert policy.select([hot, cold], req(prompt)).id == "hot"
    hot.in_flight, cold.in_flight = 100, 80  # gap 20 and 100 < 80 * 1.5
    assert policy.select([hot, cold], req(prompt)).id == "hot"


def test_eviction_keeps_each_worker_bounded() -> None:
    policy = CacheAwarePolicy(max_tree_size=1000)
    workers = make_workers(2)
    system = ids(50)
    for _ in range(300):
        policy.select(workers, req(system + ids(rng.randrange(20, 150))))
        assert all(policy.cached_tokens(w) <= 1000 for w in workers)
    assert held_sizes(policy._routed.tree) == {w.id: policy.cached_tokens(w) for w in workers}
    assert policy._routed.tree.node_count() < 200


def test_eviction_drops_least_recently_used_first() -> None:
    tree = PrefixTree()
    for text in ("aaaa", "bbbb", "cccc"):
        tree.insert("", text, "w")
    tree.insert("", "aaaa", "w")  # touch: "bbbb" is now the oldest
    tree.evict("w", 8)
    assert tree.match("", "bbbb", {"w"}) == (0, [])
    assert tree.match("", "aaaa", {"w"}) == (4, ["w"])
    assert tree.match("", "cccc", {"w"}) == (4, ["w"])
    assert tree.size("w") == 8


def test_eviction_trims_leaves_before_shared_prefixes() -> None:
    tree = PrefixTree()
    tree.insert("", "prefix-one", "w")
    tree.insert("", "prefix-two", "w")
    tree.evict("w", 7)
    assert tree.size("w") == 7
    assert tree.match("", "prefix-two", {"w"}) == (7, ["w"])


def test_prompt_longer_than_the_bound_is_recorded_truncated() -> None:
    policy = CacheAwarePolicy(max_tree_size=100)
    worker = make_worker("only")
    policy.select([worker], req(ids(500)))
    assert policy.cached_tokens(worker) <= 100


def test_selection_text_mode_keys_on_the_last_user_message() -> None:
    policy = create_policy("cache_aware", cache_key="selection-text")
    workers = make_workers(3)
    questions = [f"Question {i}: {'explain the plot of a long novel in detail ' * 4}" for i in range(6)]
    first = [policy.select(workers, req(ids(30), text=q)).id for q in questions]
    assert len(set(first)) == 3
    for q, home in zip(questions, first, strict=True):
        # Different token ids every time; only the text is the key.
        assert policy.select(workers, req(ids(30), text=q)).id == home
    assert all(policy.cached_tokens(w) > 0 for w in workers)


def test_removing_a_worker_drops_its_entries() -> None:
    policy = CacheAwarePolicy()
    workers = make_workers(3)
    prompts = [ids(300) for _ in range(6)]
    homes = [policy.select(workers, req(p)) for p in prompts]
    gone = homes[0]
    nodes_before = policy._routed.tree.node_count()
    policy.on_worker_removed(gone)
    assert policy.cached_tokens(gone) == 0
    assert gone.id not in held_sizes(policy._routed.tree)
    assert policy._routed.tree.node_count() < nodes_before
    remaining = [w for w in workers if w is not gone]
    for p, home in zip(prompts, homes, strict=True):
        chosen = policy.select(remaining, req(p))
        if home is not gone:
            assert chosen is home


def test_unavailable_holder_is_not_matched() -> None:
    policy = CacheAwarePolicy()
    a, b = make_worker("a"), make_worker("b", in_flight=1)
    prompt = ids(1000)
    assert policy.select([a, b], req(prompt)) is a
    a.healthy = False
    assert policy.select([a, b], req(prompt)) is b
    a.healthy = True
    assert policy.select([a, b], req(prompt)) is a  # both hold it now; a is less loaded


def test_tree_splits_edges_and_matches_partially() -> None:
    tree = PrefixTree()
    tree.insert("", "hello world", "a")
    tree.insert("", "hello there", "b")
    assert tree.match("", "hello world!", {"a", "b"}) == (11, ["a"])
    assert tree.match("", "hello wonder", {"a", "b"}) == (8, ["a"])
    assert sorted(tree.match("", "hello", {"a", "b"})[1]) == ["a", "b"]
    assert tree.match("", "hello world", {"b"}) == (6, ["b"])
    assert (tree.size("a"), tree.size("b")) == (11, 11)
    assert held_sizes(tree) == {"a": 11, "b": 11}


def test_matches_gives_each_workers_own_match_length() -> None:
    tree = PrefixTree()
    tree.insert("", "hello world", "a")
    tree.insert("", "hello there", "b")
    tree.insert("", "help", "c")
    assert tree.matches("", "hello world!", {"a", "b", "c"}) == {"a": 11, "b": 6, "c": 3}
    assert tree.matches("", "hello world!", {"b"}) == {"b": 6}
    assert tree.matches("", "goodbye", {"a", "b", "c"}) == {}
    assert tree.matches("other", "hello world", {"a", "b", "c"}) == {}


def test_token_keys_split_on_token_boundaries() -> None:
    policy = CacheAwarePolicy()
    # 0x0100 and 0x0101 share their low bytes; a byte-level split would count a partial token.
    a = [7, 0x0100, 9]
    b = [7, 0x0101, 9]
    tree = policy._routed.tree
    tree.insert("", pack_token_ids(a), "x")
    assert tree.match("", pack_token_ids(b), {"x"}) == (1, ["x"])
    assert tree.match("", pack_token_ids(a[:2] + [5]), {"x"}) == (2, ["x"])


def test_invalid_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="cache_key"):
        CacheAwarePolicy(cache_key="prompt")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CacheAwarePolicy(cache_threshold=1.5)


def _cost_per_token(prompt_tokens: int) -> float:
    """Seconds per prompt token of a cache-aware select over 8 workers whose cache holds 100 prompts of
    this length sharing a system prompt: the least of several rounds, so a busy machine's pauses do not
    count (the absolute speed is a benchmark's business; here only how it grows)."""
    policy = CacheAwarePolicy()
    workers = make_workers(8)
    system = ids(prompt_tokens // 5)
    prompts = [req(system + ids(prompt_tokens - len(system))) for _ in range(100)]
    for r in prompts:
        policy.select(workers, r)
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for r in prompts[:20]:
            policy.select(workers, r)
        rounds.append((time.perf_counter() - started) / 20)
    return min(rounds) / prompt_tokens


def test_selection_cost_grows_linearly_with_the_prompt() -> None:
    short, long = _cost_per_token(800), _cost_per_token(8000)
    # Linear: the same cost per token at ten times the length (quadratic work would cost ten times more).
    assert long < 3 * short, (short, long)


def test_prompt_cache_key_sticks_below_the_prefix_threshold() -> None:
    """Requests sharing a `prompt_cache_key` share a worker even when their prompts share little."""
    policy = CacheAwarePolicy(cache_threshold=0.9)
    workers = make_workers(4)
    first = policy.select(workers, RoutingRequest("m", ids(50), cache_key="session-1"))
    for _ in range(20):
        chosen = policy.select(workers, RoutingRequest("m", ids(50), cache_key="session-1"))
        assert chosen is first
    spread = {policy.select(workers, RoutingRequest("m", ids(50), cache_key=f"s{i}")).id for i in range(40)}
    assert len(spread) > 1  # other keys still spread


def test_prompt_cache_key_yields_to_imbalance_and_unavailability() -> None:
    policy = CacheAwarePolicy()
    hot, cold = make_worker("hot"), make_worker("cold", in_flight=1)
    assert policy.select([hot, cold], RoutingRequest("m", ids(10), cache_key="k")) is hot
    hot.in_flight = 40
    assert policy.select([hot, cold], RoutingRequest("m", ids(10), cache_key="k")) is cold
    assert policy.select([cold], RoutingRequest("m", ids(10), cache_key="k")) is cold


def test_prompt_cache_keys_are_bounded() -> None:
    policy = CacheAwarePolicy(max_cache_keys=3)
    workers = make_workers(2)
    for i in range(10):
        policy.select(workers, RoutingRequest("m", ids(5), cache_key=f"k{i}"))
    assert list(policy._routed.keys) == [tenant_key("", k) for k in ("k7", "k8", "k9")]
