"""A lease: at most one node at a time does a job (reading the table's stream).

Like the presence writer's lease (``server/cluster.py``), and with the same Lua
scripts: a key holding the holder's random token, set with ``NX`` and a ttl,
renewed by its holder only. Redis can forget it (a restart), so a lease is not
proof on its own: work with durable effects is fenced elsewhere as well (the
stream reader's checkpoints carry a fence number from DynamoDB).

Embedded, the one process is the only candidate: :class:`MemoryLease` is always held.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Protocol

import redis.asyncio as aioredis

from server import cluster_lua


class LeaseState(enum.Enum):
    ACQUIRED = "acquired"
    """Newly taken: whatever the previous holder did must be reloaded."""
    RENEWED = "renewed"
    """Still ours, without a break."""
    LOST = "lost"
    """Another node holds it."""


class Lease(Protocol):
    @property
    def valid_until(self) -> float:
        """``time.monotonic()`` until which the lease is surely ours (0 if not held)."""

    async def renew(self) -> LeaseState:
        """Take the lease or renew it; raises if the lease store is unreachable."""

    async def release(self) -> None:
        """Give it up so another node takes over at once."""

    async def close(self) -> None: ...


class MemoryLease:
    """Embedded: one process, always the holder."""

    def __init__(self) -> None:
        self._held = False

    @property
    def valid_until(self) -> float:
        return float("inf") if self._held else 0.0

    async def renew(self) -> LeaseState:
        state = LeaseState.RENEWED if self._held else LeaseState.ACQUIRED
        self._held = True
        return state

    async def release(self) -> None:
        self._held = False

    async def close(self) -> None:
        self._held = False


class RedisLease:
    """One key, ``<token>`` with a ttl of ``lease_ms``; renew well within it."""

    def __init__(self, client: aioredis.Redis, key: str, token: str, lease_ms: int) -> None:
        self._client = client
        self._key = key
        self.token = token
        self._lease_ms = lease_ms
        self._valid_until = 0.0
        self._lead = client.register_script(cluster_lua.LEAD)
        self._release = client.register_script(cluster_lua.RELEASE)

    @property
    def valid_until(self) -> float:
        return self._valid_until

    async def renew(self) -> LeaseState:
        asked = time.monotonic()  # the ttl runs from before the request, to be safe
        try:
            args: list[Any] = [self.token, self._lease_ms]
            result = int(await self._lead(keys=[self._key], args=args))
        except BaseException:
            self._valid_until = 0.0
            raise
        if result == 0:
            self._valid_until = 0.0
            return LeaseState.LOST
        # 2 while we thought we held it: the key lapsed (a Redis restart, a long
        # pause) and another node may have held it meanwhile, so it is new.
        was_held = self._valid_until > asked
        self._valid_until = asked + self._lease_ms / 1000
        return LeaseState.RENEWED if result == 1 and was_held else LeaseState.ACQUIRED

    async def release(self) -> None:
        self._valid_until = 0.0
        await self._release(keys=[self._key], args=[self.token])

    async def close(self) -> None:
        await self._client.aclose()
