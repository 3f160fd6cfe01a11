"""At most N actions per user in a sliding window, on one node or across the cluster.

The window is exact (a log of accepted times, not fixed buckets), so N posts
are allowed in any 10 s and never 2N across a bucket boundary. Refused attempts
are not logged: a client that keeps trying is not locked out for longer.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Protocol

from redis.exceptions import RedisError

from server.redis.client import command_client_for
from server.redis.scripts import lua, script_for


class RateLimiter(Protocol):
    async def allow(self, user_id: str) -> bool:
        """Count one action of ``user_id`` if under the limit; False when over it."""

    async def close(self) -> None: ...


class MemoryRateLimiter:
    def __init__(self, limit: int, window_seconds: float) -> None:
        self._limit = limit
        self._window = window_seconds
        self._log: dict[str, collections.deque[float]] = {}

    async def allow(self, user_id: str) -> bool:
        now = time.monotonic()
        times = self._log.setdefault(user_id, collections.deque())
        while times and times[0] <= now - self._window:
            times.popleft()
        if len(times) >= self._limit:
            return False
        times.append(now)
        if len(self._log) > 10_000:
            self._forget_idle(now)
        return True

    def _forget_idle(self, now: float) -> None:
        idle = [u for u, t in self._log.items() if not t or t[-1] <= now - self._window]
        for user in idle:
            del self._log[user]

    async def close(self) -> None:
        return None


_ALLOW = lua("server.coordination", "rate_allow")
"""The sliding window in one step; times come from Redis, so nodes with skewed
clocks share one window."""


def rate_key(name: str, user_id: str) -> str:
    """In the user's hash tag, beside any other per-user key."""
    return "ap:{user:" + user_id + "}:rate:" + name


class RedisRateLimiter:
    """The same window for a user on every node. Fails open: when Redis is away a
    post is not refused for it, it is limited by this node's own window instead."""

    def __init__(
        self, url: str, name: str, limit: int, window_seconds: float, *, cluster: bool = False
    ) -> None:
        self._client = command_client_for(url, cluster=cluster)
        self._script = script_for(self._client, _ALLOW)
        self._name = name
        self._limit = limit
        self._window_ms = int(window_seconds * 1000)
        self._fallback = MemoryRateLimiter(limit, window_seconds)
        self._counter = 0

    async def allow(self, user_id: str) -> bool:
        self._counter += 1
        member = f"{time.time_ns()}-{id(self)}-{self._counter}"
        try:
            allowed = await self._script(
                keys=[rate_key(self._name, user_id)],
                args=[self._window_ms, self._limit, member],
            )
        except (RedisError, OSError):
            return await self._fallback.allow(user_id)
        return bool(allowed)

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
