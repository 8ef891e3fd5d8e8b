from __future__ import annotations

import pytest

import harmony_gateway.routing as routing
from harmony_gateway.routing import POLICIES, CacheAwarePolicy, create_policy


def test_table_names_match_policy_names() -> None:
    assert set(POLICIES) == {
        "round_robin",
        "random",
        "power_of_two",
        "cache_aware",
        "kv_aware",
        "consistent_hash",
    }
    for name, cls in POLICIES.items():
        assert cls.name == name
        assert create_policy(name).name == name


def test_options_reach_the_constructor() -> None:
    policy = create_policy("cache_aware", cache_threshold=0.8, max_tree_size=10)
    assert isinstance(policy, CacheAwarePolicy)
    assert (policy.cache_threshold, policy.max_tree_size) == (0.8, 10)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="least_load") as info:
        create_policy("least_load")
    for name in POLICIES:
        assert name in str(info.value)


def test_exported_members() -> None:
    assert sorted(routing.__all__) == sorted(set(routing.__all__))
    for name in routing.__all__:
        assert getattr(routing, name) is not None
    public = {n for n in dir(routing) if not n.startswith("_")}
    modules = {
        "cache_aware",
        "consistent_hash",
        "dns_discovery",
        "dns_resolver",
        "fleet",
        "health",
        "kv_aware",
        "kv_index",
        "kv_subscriptions",
        "policy",
        "power_of_two",
        "random_policy",
        "registry",
        "round_robin",
        "shared_registry",
        "url_policy",
        "workers",
    }
    assert public - modules == set(routing.__all__)
