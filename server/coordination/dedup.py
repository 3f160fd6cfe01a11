"""Which deliveries were already published, remembered cluster-wide for a while.

SQS delivers a message at least once, sometimes to two nodes at the same time, and
a table-stream reader may read a record again after a crash or a lease handover.
Both ask here before they publish, so that each event reaches clients once.

A key goes through two states:

- *pending*: one consumer claimed it and is publishing it. The claim lives as long
  as the message stays invisible to the other consumers; a consumer that dies
  leaves it to expire, and one that fails to publish releases it at once.
- *done*: published. Kept for the dedup window, then forgotten.

Three implementations share one contract suite (``tests/contract``): a dict for the
embedded default, and Redis (``SET NX`` with a ttl, in Lua) for a cluster on one
Redis (``--redis-url``) or on a Redis Cluster (``--redis-cluster-url``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import redis.asyncio as aioredis

from server.redis.client import through_failover
from server.redis.scripts import ShardScript, lua
from server.runtime.metrics import Counter

if TYPE_CHECKING:
    from server.bus.redis_cluster_bus import RedisClusterBus


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


_CLAIM = lua("server.coordination", "dedup_claim")
_RELEASE = lua("server.coordination", "release")

_CLAIM_RESULTS = {1: Claim.CLAIMED, 0: Claim.DONE, -1: Claim.BUSY}


class RedisDedup:
    """Across the cluster, on one Redis: one single-key script call per key, pipelined."""

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


class RedisClusterDedup:
    """Across the cluster, on a Redis Cluster: one single-key call per key, sent concurrently.

    Each script names exactly one key, so it runs in that key's slot whatever the
    key is (no hash tag needed, and none would help: the deliveries of a batch have
    nothing in common to group them by). A batch is therefore not one multi-key
    script, which a cluster refuses across slots, nor a cluster pipeline, whose
    retry closes the whole client under the other callers. That stays correct:

    - every key's answer is decided on its own, in one atomic script; a batch
      never needed all-or-nothing, since each message is published, deleted or
      handed back on its own;
    - each call is idempotent for its token (a claim already ours is extended,
      ``done`` is set again, ``release`` frees only our claim), so a call retried
      through a failover (``through_failover``) or by redis-py gives the same answer;
    - a claim that fails part-way releases the keys it did claim, so a retry of
      the batch, here or on another node, finds them free instead of BUSY.

    What a failover can still lose is what Redis replicates asynchronously: a
    ``done`` mark written just before the primary died. The caller deleted or
    checkpointed that delivery right after marking it, so it comes back only if
    that also failed.
    """

    MAX_IN_FLIGHT = 32
    """Calls at once per instance: below the cluster client's per-node pool, which
    raises instead of waiting when it runs out."""

    def __init__(
        self, client: Any, *, failover_seconds: float = 10.0, retries: Counter | None = None
    ) -> None:
        self._client = client
        self._failover_seconds = failover_seconds
        self._retries = retries
        self._claim = ShardScript(client, _CLAIM)
        self._release = ShardScript(client, _RELEASE)
        self._slots = asyncio.Semaphore(self.MAX_IN_FLIGHT)
        self._initialized = False
        self._initializing = asyncio.Lock()

    @classmethod
    def on_cluster(cls, bus: RedisClusterBus) -> RedisClusterDedup:
        """On the Redis Cluster of ``bus``, with a command client of its own."""
        return cls(
            bus.command_client(),
            failover_seconds=bus.publish_deadline,
            retries=bus.pipes.retries,
        )

    async def _ready(self) -> None:
        # The slot map and first connections before any concurrent use: a fresh
        # cluster client used by many callers at once broke its own connections.
        if self._initialized:
            return
        async with self._initializing:
            if not self._initialized:
                await self._client.initialize()
                self._initialized = True

    async def _each(self, calls: Sequence[Callable[[], Awaitable[Any]]]) -> list[Any]:
        """Run the calls at once, each retried through a failover; results or exceptions."""
        await self._ready()
        deadline = time.monotonic() + self._failover_seconds

        async def bounded(call: Callable[[], Awaitable[Any]]) -> Any:
            async with self._slots:
                return await through_failover(call, deadline, retries=self._retries)

        return await asyncio.gather(*(bounded(call) for call in calls), return_exceptions=True)

    async def claim(self, keys: Sequence[str], token: str, pending_seconds: float) -> list[Claim]:
        if not keys:
            return []
        ms = max(1, int(pending_seconds * 1000))
        mine = _pending(token)
        results = await self._each(
            [partial(self._claim, keys=[key], args=[mine, ms]) for key in keys]
        )
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            claimed = [
                key
                for key, result in zip(keys, results, strict=True)
                if not isinstance(result, BaseException) and int(result) == 1
            ]
            with contextlib.suppress(Exception):
                await self.release(claimed, token)
            raise failure
        return [_CLAIM_RESULTS[int(result)] for result in results]

    async def complete(self, keys: Sequence[str], done_seconds: float) -> None:
        ms = max(1, int(done_seconds * 1000))
        await self._all([partial(self._client.set, key, _DONE, px=ms) for key in keys])

    async def release(self, keys: Sequence[str], token: str) -> None:
        mine = _pending(token)
        await self._all([partial(self._release, keys=[key], args=[mine]) for key in keys])

    async def _all(self, calls: Sequence[Callable[[], Awaitable[Any]]]) -> None:
        if not calls:
            return
        for result in await self._each(calls):
            if isinstance(result, BaseException):
                raise result

    async def close(self) -> None:
        await self._client.aclose()
