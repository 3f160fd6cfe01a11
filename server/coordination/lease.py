"""A lease: at most one node at a time does a job (reading the table's stream).

Like the presence writer's lease (``server/presence/redis.py``), and with the same Lua
scripts: a key holding the holder's random token, set with ``NX`` and a ttl,
renewed by its holder only. Redis can forget it (a restart), so a lease is not
proof on its own: work with durable effects is fenced elsewhere as well (the
stream reader's checkpoints carry a fence number from DynamoDB).

On a Redis Cluster (:meth:`RedisLease.on_cluster`) the lease is still one key:
its hash tag (``ap:{notifications}:leader``) names its slot, and each script
touches that key only. Its fence is not in Redis but in the table, so there is
no second key to keep beside it. A renewal retries through a failover of that
slot's primary, as stream appends do, for at most one lease term.

Embedded, the one process is the only candidate: :class:`MemoryLease` is always held.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from server.presence import scripts as cluster_lua
from server.redis.client import through_failover
from server.redis.scripts import script_for

if TYPE_CHECKING:
    from server.bus.redis_cluster_bus import RedisClusterBus

T = TypeVar("T")


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
    """One key, ``<token>`` with a ttl of ``lease_ms``; renew well within it.

    ``client`` is a Redis client, or a Redis Cluster client with ``through_failover``
    set: both scripts are idempotent for a token (renewing twice renews, releasing
    twice releases), so a call retried after its reply was lost is harmless.
    """

    def __init__(
        self, client: Any, key: str, token: str, lease_ms: int, *, through_failover: bool = False
    ) -> None:
        self._client = client
        self._key = key
        self.token = token
        self._lease_ms = lease_ms
        self._valid_until = 0.0
        self._retry = through_failover
        self._lead = script_for(client, cluster_lua.LEAD)
        self._release = script_for(client, cluster_lua.RELEASE)

    @classmethod
    def on_cluster(cls, bus: RedisClusterBus, key: str, token: str, lease_ms: int) -> RedisLease:
        """On the Redis Cluster of ``bus``, with a command client of its own."""
        return cls(bus.command_client(), key, token, lease_ms, through_failover=True)

    async def _call(self, call: Callable[[], Awaitable[T]], started: float) -> T:
        if not self._retry:
            return await call()
        # Past one lease term there is nothing left to keep: any holder's key lapsed.
        return await through_failover(call, started + self._lease_ms / 1000)

    @property
    def valid_until(self) -> float:
        return self._valid_until

    async def renew(self) -> LeaseState:
        asked = time.monotonic()  # the ttl runs from before the request, to be safe
        try:
            args: list[Any] = [self.token, self._lease_ms]
            result = int(await self._call(lambda: self._lead(keys=[self._key], args=args), asked))
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
        release = self._release
        await self._call(lambda: release(keys=[self._key], args=[self.token]), time.monotonic())

    async def close(self) -> None:
        await self._client.aclose()
