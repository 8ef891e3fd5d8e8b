"""Routing state is per tenant: no lookup of one tenant matches an entry another tenant recorded, in the
cache-aware prefix index, its `prompt_cache_key` map, or the consistent-hash keys."""

from __future__ import annotations

from typing import Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from harmony_gateway.routing import CacheAwarePolicy, ConsistentHashPolicy, RoutingRequest
from harmony_gateway.routing.cache_aware import PrefixTree

from ._fakes import make_workers

TENANTS = ["", "tenant-a", "tenant-b"]
# A small alphabet so that prompts of different tenants share long prefixes often.
texts = st.text(alphabet="ab", max_size=12)
token_lists = st.lists(st.integers(0, 2), max_size=12)


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(
    inserts=st.lists(st.tuples(st.sampled_from(TENANTS), texts, st.sampled_from(["w0", "w1"])), max_size=20),
    probes=st.lists(st.tuples(st.sampled_from(TENANTS), texts), min_size=1, max_size=10),
    evict_to=st.none() | st.integers(0, 30),
)
def test_a_lookup_matches_only_its_own_namespace(
    inserts: list[tuple[str, str, str]], probes: list[tuple[str, str]], evict_to: int | None
) -> None:
    tree = PrefixTree()
    for namespace, key, worker in inserts:
        tree.insert(namespace, key, worker)
    if evict_to is not None:
        tree.evict("w0", evict_to)
    for namespace, probe in probes:
        own = [key for ns, key, _ in inserts if ns == namespace]
        matched, holders = tree.match(namespace, probe, {"w0", "w1"})
        # Never longer than the probe shares with a key of its own namespace (eviction only shortens).
        assert matched <= max((common_prefix(probe, key) for key in own), default=0)
        if evict_to is None:
            assert matched == max((common_prefix(probe, key) for key in own), default=0)
        assert bool(holders) == bool(matched)


@settings(max_examples=200, deadline=None)
@given(
    inserts=st.lists(st.tuples(st.sampled_from(TENANTS), texts, st.sampled_from(["w0", "w1"])), max_size=20),
    probes=st.lists(st.tuples(st.sampled_from(TENANTS), texts), min_size=1, max_size=10),
)
def test_each_workers_match_comes_from_its_own_namespace(
    inserts: list[tuple[str, str, str]], probes: list[tuple[str, str]]
) -> None:
    """`matches` gives every worker the longest prefix it was sent in the probe's namespace, and no more."""
    tree = PrefixTree()
    for namespace, key, worker in inserts:
        tree.insert(namespace, key, worker)
    for namespace, probe in probes:
        expected = {}
        for worker in ("w0", "w1"):
            own = [key for ns, key, w in inserts if ns == namespace and w == worker]
            longest = max((common_prefix(probe, key) for key in own), default=0)
            if longest:
                expected[worker] = longest
        assert tree.matches(namespace, probe, {"w0", "w1"}) == expected


Request = tuple[str, list[int], str]


@settings(max_examples=150, deadline=None)
@given(
    cache_key=st.sampled_from(["tokens", "selection-text"]),
    requests=st.lists(st.tuples(st.sampled_from(TENANTS), token_lists, texts), max_size=20),
    probe=st.tuples(token_lists, texts),
)
def test_other_tenants_traffic_leaves_a_tenants_cache_match_unchanged(
    cache_key: Literal["tokens", "selection-text"], requests: list[Request], probe: tuple[list[int], str]
) -> None:
    """What the inspector shows a tenant (`match_length`) is what it would be had no other tenant sent
    anything: the shared policy agrees with one that saw only that tenant's requests."""
    workers = make_workers(3)
    shared = CacheAwarePolicy(cache_key=cache_key)
    alone = {tenant: CacheAwarePolicy(cache_key=cache_key) for tenant in TENANTS}
    for tenant, input_ids, text in requests:
        request = RoutingRequest("m", input_ids, selection_text=text, tenant=tenant)
        shared.select(workers, request)
        alone[tenant].select(workers, request)
    for tenant in TENANTS:
        asked = RoutingRequest("m", probe[0], selection_text=probe[1], tenant=tenant)
        assert shared.match_length(workers, asked) == alone[tenant].match_length(workers, asked)


def test_a_secret_prefix_of_one_tenant_is_no_match_for_another() -> None:
    policy = CacheAwarePolicy()
    workers = make_workers(2)
    secret = list(range(1000, 1400))
    policy.select(workers, RoutingRequest("m", secret, tenant="tenant-a"))
    for cut in (1, 50, 399, 400):
        guess = RoutingRequest("m", secret[:cut], tenant="tenant-b")
        assert policy.match_length(workers, guess) == 0
        assert policy.match_length(workers, RoutingRequest("m", secret[:cut], tenant="tenant-a")) == cut


def test_prompt_cache_key_follows_only_its_own_tenant() -> None:
    """B sending A's `prompt_cache_key` is placed as for a key of its own it never used, not on A's
    worker (which, holding A's prompt, is the last place a new key goes)."""
    policy = CacheAwarePolicy()
    workers = make_workers(3)
    a_home = policy.select(workers, RoutingRequest("m", list(range(50)), cache_key="k", tenant="a"))
    assert policy.peek(workers, RoutingRequest("m", [1], cache_key="k", tenant="a")) is a_home
    b_with_a_key = policy.peek(workers, RoutingRequest("m", [1], cache_key="k", tenant="b"))
    b_new_key = policy.peek(workers, RoutingRequest("m", [1], cache_key="new", tenant="b"))
    assert b_with_a_key is b_new_key is not a_home


def test_consistent_hash_places_each_tenants_keys_independently() -> None:
    policy = ConsistentHashPolicy()
    workers = make_workers(8)
    keys = [f"session-{i}" for i in range(400)]

    def placement(tenant: str) -> list[str]:
        return [
            policy.select(workers, RoutingRequest("m", [1], routing_key=k, tenant=tenant)).id for k in keys
        ]

    a, b = placement("tenant-a"), placement("tenant-b")
    assert placement("tenant-a") == a  # stable within a tenant
    same = sum(x == y for x, y in zip(a, b, strict=True))
    assert same < 150, same  # ~1/8 agree by chance; all would if keys were global
