"""Which deliveries were already published, remembered cluster-wide for a while.

SQS delivers a message at least once, sometimes to two nodes at the same time, and
a table-stream reader may read a record again after a crash or a lease handover.
Both ask here before they publish, so that each event reaches clients once.

A key goes through two states:

- *pending*: one consumer claimed it and is publishing it. The claim lives as long
  as the message stays invisible to the other consumers; a consumer that dies
  leaves it to expire, and one that fails to publish releases it at once.
- *done*: published. Kept for the dedup window, then forgotten.

Two implementations share one contract suite (``tests/contract``): a dict for the
embedded default and Redis (``SET NX`` with a ttl, in Lua) for a cluster.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any, Protocol

import redis.asyncio as aioredis


class Claim(enum.Enum):
    CLAIMED = "claimed"
    """Yours: publish it, then ``complete`` (or ``release`` if publishing failed)."""
    DONE = "done"
    """Already published: do not publish again."""
    BUSY = "busy"
    """Another consumer holds a claim and is publishing it: look again later."""


class Dedup(Protocol):
    async def claim(self, keys: Sequence[str], token: str, pending_seconds: float) -> list[Claim]:
        """Claim each key for ``token`` unless it is done or claimed by another token.

        A key this token already holds is CLAIMED again (its claim is extended).
        """

    async def complete(self, keys: Sequence[str], done_seconds: float) -> None:
        """Mark keys published; they read DONE for ``done_seconds``."""

    async def release(self, keys: Sequence[str], token: str) -> None:
        """Drop this token's claims (publishing failed): the keys are free again."""

    async def close(self) -> None: ...


_DONE = "d"


def _pending(token: str) -> str:
    return "p:" + token


class MemoryDedup:
    """One process: the embedded default, where one bridge is the only consumer."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[str, tuple[str, float]] = {}  # key -> (value, expires at)
        self._next_sweep = 0.0

    def _get(self, key: str, now: float) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._entries[key]
            return None
        return entry[0]

    def _sweep(self, now: float) -> None:
        # Bounded memory without a timer: drop expired keys now and then.
        if now < self._next_sweep:
            return
        self._next_sweep = now + 10.0
        for key in [k for k, (_, expires) in self._entries.items() if expires <= now]:
            del self._entries[key]

    async def claim(self, keys: Sequence[str], token: str, pending_seconds: float) -> list[Claim]:
        now = self._clock()
        self._sweep(now)
        mine = _pending(token)
        results: list[Claim] = []
        for key in keys:
            value = self._get(key, now)
            if value is None or value == mine:
                self._entries[key] = (mine, now + pending_seconds)
                results.append(Claim.CLAIMED)
            elif value == _DONE:
                results.append(Claim.DONE)
            else:
                results.append(Claim.BUSY)
        return results

    async def complete(self, keys: Sequence[str], done_seconds: float) -> None:
        expires = self._clock() + done_seconds
        for key in keys:
            self._entries[key] = (_DONE, expires)

    async def release(self, keys: Sequence[str], token: str) -> None:
        now, mine = self._clock(), _pending(token)
        for key in keys:
            if self._get(key, now) == mine:
                del self._entries[key]

    async def close(self) -> None:
        self._entries.clear()


_CLAIM = """
-- KEYS: the key.  ARGV: pending value, pending ttl ms.
-- 1 claimed (or already ours: extended), 0 done, -1 claimed by another.
local value = redis.call('GET', KEYS[1])
if not value or value == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if value == 'd' then return 0 end
return -1
"""

_RELEASE = """
-- KEYS: the key.  ARGV: pending value.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_CLAIM_RESULTS = {1: Claim.CLAIMED, 0: Claim.DONE, -1: Claim.BUSY}


class RedisDedup:
    """Across the cluster: one key per delivery, each its own Redis Cluster slot.

    Each key is one single-key script call in a pipeline (not one multi-key script),
    so that keys spread over the slots of a Redis Cluster.
    """

    def __init__(self, client: aioredis.Redis, *, owns_client: bool = True) -> None:
        self._client = client
        self._owns_client = owns_client
        self._claim = client.register_script(_CLAIM)
        self._release = client.register_script(_RELEASE)

    async def claim(self, keys: Sequence[str], token: str, pending_seconds: float) -> list[Claim]:
        if not keys:
            return []
        ms = max(1, int(pending_seconds * 1000))
        # ``async with``: a pipeline that failed gives its connection back to the pool.
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                await self._claim(keys=[key], args=[_pending(token), ms], client=pipe)
            results = await pipe.execute()
        return [_CLAIM_RESULTS[int(result)] for result in results]

    async def complete(self, keys: Sequence[str], done_seconds: float) -> None:
        if not keys:
            return
        ms = max(1, int(done_seconds * 1000))
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.set(key, _DONE, px=ms)
            await pipe.execute()

    async def release(self, keys: Sequence[str], token: str) -> None:
        if not keys:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                await self._release(keys=[key], args=[_pending(token)], client=pipe)
            await pipe.execute()

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()
