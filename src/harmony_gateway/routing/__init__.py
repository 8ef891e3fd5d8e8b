"""Routing: choosing a worker for each request, and keeping worker health and circuit breakers.

`create_policy(name, **options)` builds a `RoutingPolicy` from the `POLICIES` table; `HealthChecker`
runs in the app's lifespan task group; the pipeline reports request outcomes with `record_success` /
`record_failure`. Under `serve --workers N`, `SharedWorkers` shares registered workers and their health
between the processes through storage. `DnsDiscovery` adds and drains workers as a DNS name's addresses
come and go (`--worker-dns`). `KvSubscriptions` follows each worker's engine: its KV events into a
`KvIndex`, its pushed loads and silence onto the worker.
"""

from .cache_aware import CacheAwarePolicy
from .consistent_hash import ConsistentHashPolicy
from .dns_discovery import DnsDiscovery, DnsTarget, parse_dns_target
from .health import BreakerConfig, HealthChecker, HealthConfig, record_failure, record_probe, record_success
from .kv_aware import KvAwarePolicy
from .kv_index import KvIndex
from .kv_subscriptions import FeedConfig, KvSubscriptions
from .policy import RoutingPolicy, RoutingRequest, available_workers
from .power_of_two import PowerOfTwoPolicy
from .random_policy import RandomPolicy
from .registry import POLICIES, create_policy
from .round_robin import RoundRobinPolicy
from .shared_registry import SharedWorkers
from .workers import BreakerState, Worker, WorkerKind, healthy_workers

__all__ = [
    "POLICIES",
    "BreakerConfig",
    "BreakerState",
    "CacheAwarePolicy",
    "ConsistentHashPolicy",
    "DnsDiscovery",
    "DnsTarget",
    "FeedConfig",
    "HealthChecker",
    "HealthConfig",
    "KvAwarePolicy",
    "KvIndex",
    "KvSubscriptions",
    "PowerOfTwoPolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "RoutingRequest",
    "SharedWorkers",
    "Worker",
    "WorkerKind",
    "available_workers",
    "create_policy",
    "healthy_workers",
    "parse_dns_target",
    "record_failure",
    "record_probe",
    "record_success",
]
