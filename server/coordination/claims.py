"""Claims: "only the first asker in this period does it", on one node or cluster-wide.

Used to write ``USERS.lastSeen`` at most once per user per 15 minutes however
many tabs and nodes see that user: the first ``claim`` wins until it expires.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Protocol

from redis.exceptions import RedisError

from server.redis.client import command_client_for


class Claims(Protocol):
    async def claim(self, name: str, ttl_seconds: float) -> bool:
        """True for the first caller of ``name`` (a user id) until ``ttl_seconds`` pass."""

    async def claim_many(self, names: Sequence[str], ttl_seconds: float) -> set[str]:
        """``claim`` of each name, in one round trip; the names won."""

    async def close(self) -> None: ...


class MemoryClaims:
    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    async def claim(self, name: str, ttl_seconds: float) -> bool:
        now = time.monotonic()
        if self._until.get(name, 0.0) > now:
            return False
        self._until[name] = now + ttl_seconds
        if len(self._until) > 50_000:
            self._until = {k: v for k, v in self._until.items() if v > now}
        return True

    async def claim_many(self, names: Sequence[str], ttl_seconds: float) -> set[str]:
        return {name for name in names if await self.claim(name, ttl_seconds)}

    async def close(self) -> None:
        return None


def claim_key(purpose: str, user_id: str) -> str:
    """In the user's hash tag, beside the user's other keys."""
    return "ap:{user:" + user_id + "}:" + purpose


class RedisClaims:
    """``SET NX PX`` per name. While Redis is away, claims fall back to this node's
    memory: a write may then happen once per node, and the store's own condition
    (missing or older than 15 minutes) still stops the extra ones."""

    def __init__(self, url: str, purpose: str, *, cluster: bool = False) -> None:
        self._client = command_client_for(url, cluster=cluster)
        self._purpose = purpose
        self._fallback = MemoryClaims()

    async def claim(self, name: str, ttl_seconds: float) -> bool:
        try:
            won = await self._client.set(
                claim_key(self._purpose, name), "1", nx=True, px=max(1, int(ttl_seconds * 1000))
            )
        except (RedisError, OSError):
            return await self._fallback.claim(name, ttl_seconds)
        return bool(won)

    async def claim_many(self, names: Sequence[str], ttl_seconds: float) -> set[str]:
        if not names:
            return set()
        px = max(1, int(ttl_seconds * 1000))
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.set(claim_key(self._purpose, name), "1", nx=True, px=px)
                won = await pipe.execute()
        except (RedisError, OSError):
            return await self._fallback.claim_many(names, ttl_seconds)
        return {name for name, ok in zip(names, won, strict=True) if ok}

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
