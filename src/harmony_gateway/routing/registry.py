"""Routing policies by name: the table `Settings` names are looked up in.

Adding a policy is one file plus one line here; `tests/routing/test_policy_contract.py` runs the
shared contract over every entry.
"""

from __future__ import annotations

from typing import Any

from .cache_aware import CacheAwarePolicy
from .consistent_hash import ConsistentHashPolicy
from .kv_aware import KvAwarePolicy
from .policy import RoutingPolicy
from .power_of_two import PowerOfTwoPolicy
from .random_policy import RandomPolicy
from .round_robin import RoundRobinPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "cache_aware": CacheAwarePolicy,
    "kv_aware": KvAwarePolicy,
    "consistent_hash": ConsistentHashPolicy,
}


def create_policy(name: str, **options: Any) -> RoutingPolicy:
    """A new policy instance; `options` are its constructor's keyword arguments.

    Raises ValueError naming the valid policies when `name` is unknown; the constructor's own
    TypeError/ValueError propagates for bad options.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        valid = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown routing policy {name!r}; valid policies: {valid}") from None
    return cls(**options)
