"""Per-key budgets: token buckets of `limit` per minute, refilled continuously.

Two buckets per key (or per client address when the gateway has no keys): requests (each route's
weight taken at admission) and tokens (the request's estimated tokens are reserved at admission and
settled to the real count when it ends, so concurrent requests cannot spend the same balance; an answer
longer than its reservation drives the balance below zero and later requests wait until it refills).
Buckets live in this process (`LocalBuckets`) or in Redis (`RedisBuckets`: one Lua script per
operation, so concurrent replicas never race; Redis's own clock, so replicas' clocks need not agree).
A bucket is kept until it has refilled, its debt included: forgetting it earlier would hand a key in
debt a full budget. When Redis cannot be reached the gateway keeps serving on local buckets, logs it
once and sets `gateway_rate_limit_store_up` to 0; it tries Redis again after `REDIS_RETRY_SECONDS`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

WINDOW_SECONDS = 60.0
REDIS_RETRY_SECONDS = 2.0
REDIS_TIMEOUT_SECONDS = 0.5
#: Kept this long past the moment a bucket is full again (clock skew between replicas, rounding).
KEY_TTL_MARGIN_SECONDS = 5


@dataclass(frozen=True, slots=True)
class BucketState:
    """A bucket after an operation: `allowed` said whether it let the request through."""

    limit: int
    level: float
    allowed: bool = True

    @property
    def remaining(self) -> int:
        return max(0, int(self.level))

    @property
    def reset_seconds(self) -> float:
        """Until the bucket is full again."""
        return refill_seconds(self.level, self.limit)

    def retry_after(self, needed: float = 1.0) -> float:
        """Until `needed` units are available (at least 1 s)."""
        return max(1.0, (needed - self.level) * WINDOW_SECONDS / self.limit)


def apply(level: float, limit: int, elapsed: float, mode: str, amount: float) -> tuple[float, bool]:
    """The bucket rule shared by both stores (the Lua script below is its twin).

    `take`: take `amount` if available (a reservation); `charge`: take `amount` even into debt, or give
    it back when negative (settling a reservation), never above `limit`; `peek`: nothing."""
    level = min(float(limit), level + elapsed * limit / WINDOW_SECONDS)
    allowed = True
    if mode == "take":
        if level >= amount:
            level -= amount
        else:
            allowed = False
    elif mode == "charge":
        level = min(float(limit), level - amount)
    return level, allowed


def refill_seconds(level: float, limit: int) -> float:
    """Until a bucket at `level` (negative: in debt) is full again."""
    return max(0.0, (limit - level) * WINDOW_SECONDS / limit)


class LocalBuckets:
    """Buckets in this process. A bucket that is full needs no memory: it is dropped when an operation
    leaves it full, and swept once its refill time has passed (`SWEEP_EVERY` operations)."""

    SWEEP_EVERY = 1024

    def __init__(self) -> None:
        #: key → (level, when it was written, when it is full again), all on the monotonic clock.
        self._buckets: dict[str, tuple[float, float, float]] = {}
        self._operations = 0

    def __len__(self) -> int:
        return len(self._buckets)

    async def run(self, key: str, limit: int, mode: str, amount: float = 0.0) -> BucketState:
        now = time.monotonic()
        level, at, _ = self._buckets.get(key, (float(limit), now, now))
        level, allowed = apply(level, limit, now - at, mode, amount)
        if level >= limit:
            self._buckets.pop(key, None)
        elif mode != "peek":
            self._buckets[key] = (level, now, now + refill_seconds(level, limit))
        self._operations += 1
        if self._operations % self.SWEEP_EVERY == 0:
            self.sweep(now)
        return BucketState(limit, level, allowed)

    def sweep(self, now: float) -> None:
        """Forget the buckets that have refilled by `now`."""
        for key in [k for k, (_, _, full_at) in self._buckets.items() if full_at <= now]:
            del self._buckets[key]


_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local limit = tonumber(ARGV[1])
local mode = ARGV[2]
local amount = tonumber(ARGV[3])
local window = tonumber(ARGV[5])
local saved = redis.call('HMGET', KEYS[1], 'level', 'at')
local level = tonumber(saved[1]) or limit
local at = tonumber(saved[2]) or now
level = math.min(limit, level + math.max(0, now - at) * limit / window)
local allowed = 1
if mode == 'take' then
  if level >= amount then level = level - amount else allowed = 0 end
elseif mode == 'charge' then
  level = math.min(limit, level - amount)
end
if mode ~= 'peek' then
  redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
  -- Kept until it has refilled, from its debt too: expiring earlier would reset a key in debt.
  local refill = math.max(0, (limit - level) * window / limit)
  redis.call('EXPIRE', KEYS[1], math.ceil(refill) + tonumber(ARGV[4]))
end
return {allowed, tostring(level)}
"""


class RedisBuckets:
    """Buckets in Redis under `prefix`, with local buckets as the fallback while Redis is down."""

    def __init__(self, url: str, *, prefix: str = "harmony-gateway:rl:") -> None:
        import redis.asyncio as redis  # lazy: redis (~9 MB) only with a Redis rate-limit store

        self.url = url
        self.prefix = prefix
        #: The store's `RateLimitStoreGauges` (traffic/middleware.py), once the app has metrics.
        self.gauges: Any = None
        self.local = LocalBuckets()
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=REDIS_TIMEOUT_SECONDS,
            socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
            retry_on_timeout=False,
        )
        self._script = self._client.register_script(_LUA)
        self._down_until = 0.0
        #: False while Redis is unreachable (budgets are then per process).
        self.up = True

    def _set_up(self, up: bool, reason: object = None) -> None:
        if up != self.up:
            if up:
                log.warning("rate-limit store %s is reachable again; budgets are shared", self._where)
            else:
                log.warning(
                    "rate-limit store %s is unreachable (%s); enforcing per-process budgets until it returns",
                    self._where,
                    reason,
                )
        self.up = up
        self.report()

    def report(self) -> None:
        """Set the store's gauge to whether Redis answers."""
        if self.gauges is not None:
            self.gauges.up.set(1 if self.up else 0)

    @property
    def _where(self) -> str:
        return self.url.split("@")[-1]

    async def run(self, key: str, limit: int, mode: str, amount: float = 0.0) -> BucketState:
        if time.monotonic() >= self._down_until:
            try:
                allowed, level = await self._script(
                    keys=[self.prefix + key],
                    args=[limit, mode, amount, KEY_TTL_MARGIN_SECONDS, WINDOW_SECONDS],
                )
            except Exception as exc:  # any Redis trouble: keep serving on local budgets
                self._down_until = time.monotonic() + REDIS_RETRY_SECONDS
                self._set_up(False, exc)
            else:
                if not self.up:
                    self._set_up(True)
                return BucketState(limit, float(level), bool(int(allowed)))
        return await self.local.run(key, limit, mode, amount)

    async def close(self) -> None:
        await self._client.aclose()


def format_reset(seconds: float) -> str:
    """OpenAI's duration format for `x-ratelimit-reset-*`: `20ms`, `6s`, `1m30s`."""
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    minutes, secs = divmod(int(seconds + 0.999), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def headers_for(kind: str, state: BucketState) -> list[tuple[bytes, bytes]]:
    return [
        (f"x-ratelimit-limit-{kind}".encode(), str(state.limit).encode()),
        (f"x-ratelimit-remaining-{kind}".encode(), str(state.remaining).encode()),
        (f"x-ratelimit-reset-{kind}".encode(), format_reset(state.reset_seconds).encode()),
    ]
