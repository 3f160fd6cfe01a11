"""A lease: at most one holder at a time of a job, across the cluster or in one process.

One implementation serves every lease the nodes take:

- the presence writer's (``ap:{presence}:leader``): the writer's ``commit`` script
  checks the lease's token in the same step as it commits (fencing), so a writer
  whose lease lapsed commits nothing (``server/presence/redis.py``);
- the table-stream reader's (``ap:{notifications}:leader``): its checkpoints carry
  a fence number from DynamoDB as well (``server/ingress/table_stream.py``);
- each game's chat lock (``ap:{game:<key>}:chat-lock``, ``game_lock.py``).

In Redis a lease is one key holding its holder's random token, with a ttl: taken
when absent, renewed by its holder only (``lua/lease_renew.lua``), given up by
compare-and-delete (``lua/release.lua``). Redis can forget it (a restart), so a
lease is not proof on its own: work with durable effects is fenced as well.

On a Redis Cluster the lease is still one key, and each script touches that key
only, so it runs in the slot of the key's hash tag whatever it is. With
``through_failover`` a call retries through a failover of that slot's primary,
for at most one lease term: past that any holder's key has lapsed anyway. Both
scripts are idempotent for a token (renewing twice renews, releasing twice
releases), so a call retried after its reply was lost is harmless.

In one process, :class:`MemoryLease` keeps the same rules over a
:class:`LeaseTable`; the embedded default's one candidate always holds it.
"""

from __future__ import annotations

import enum
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from server.redis.client import through_failover
from server.redis.scripts import lua, script_for
from server.runtime.metrics import Counter

if TYPE_CHECKING:
    from server.bus.redis_cluster_bus import RedisClusterBus

T = TypeVar("T")

RENEW = lua("server.coordination", "lease_renew")
RELEASE = lua("server.coordination", "release")

_LOST, _RENEWED, _ACQUIRED = 0, 1, 2
"""What the renew script (and :meth:`LeaseTable.renew`) answers."""


class LeaseState(enum.Enum):
    ACQUIRED = "acquired"
    """Newly taken: whatever the previous holder did must be reloaded."""
    RENEWED = "renewed"
    """Still ours, without a break."""
    LOST = "lost"
    """Another holder has it."""


class Lease(Protocol):
    key: str
    token: str
    """The holder's token: what fencing checks compare with the key's value."""

    @property
    def valid_until(self) -> float:
        """``time.monotonic()`` until which the lease is surely ours (0 if not held)."""

    async def renew(self) -> LeaseState:
        """Take the lease or renew it; raises if the lease store is unreachable."""

    async def release(self) -> None:
        """Give it up (only if still ours) so another holder takes over at once."""

    async def close(self) -> None: ...


def new_token(holder: str) -> str:
    """A token that names its holder (operators read it) and is never reused."""
    return f"{holder}/{uuid.uuid4().hex}"


class _Term:
    """What both implementations do with an answer: the state, and how long it holds.

    The ttl runs from before the request was sent, to be safe. A renewal that
    finds the key ours after the local term ran out is still reported as
    ACQUIRED: the holder stopped acting meanwhile, so what it left must be
    reloaded as after any takeover.
    """

    def __init__(self, lease_ms: int | None) -> None:
        self.lease_ms = lease_ms
        self.valid_until = 0.0

    def answer(self, result: int, asked: float) -> LeaseState:
        if result == _LOST:
            self.valid_until = 0.0
            return LeaseState.LOST
        was_held = self.valid_until > asked
        self.valid_until = math.inf if self.lease_ms is None else asked + self.lease_ms / 1000
        return LeaseState.RENEWED if result == _RENEWED and was_held else LeaseState.ACQUIRED


class LeaseTable:
    """The leases of one process, by key: what its :class:`MemoryLease`\\ s share."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._holders: dict[str, tuple[str, float]] = {}  # key -> (token, expires at)

    def renew(self, key: str, token: str, lease_ms: int | None) -> int:
        """1 renewed, 2 newly acquired, 0 held by another (the renew script's answers)."""
        now = self.clock()
        holder = self._holders.get(key)
        if holder is not None and holder[1] <= now:
            holder = None
        if holder is not None and holder[0] != token:
            return _LOST
        expires = math.inf if lease_ms is None else now + lease_ms / 1000
        self._holders[key] = (token, expires)
        return _RENEWED if holder is not None else _ACQUIRED

    def release(self, key: str, token: str) -> None:
        holder = self._holders.get(key)
        if holder is not None and holder[0] == token:
            del self._holders[key]


class MemoryLease:
    """In one process. Without ``lease_ms`` it never lapses; without a shared
    ``table`` it has no rival: the embedded default, always the holder."""

    def __init__(
        self,
        key: str = "lease",
        token: str | None = None,
        lease_ms: int | None = None,
        *,
        table: LeaseTable | None = None,
    ) -> None:
        self.key = key
        self.token = token if token is not None else new_token("local")
        self._table = table if table is not None else LeaseTable()
        self._term = _Term(lease_ms)

    @property
    def valid_until(self) -> float:
        return self._term.valid_until

    async def renew(self) -> LeaseState:
        asked = self._table.clock()
        result = self._table.renew(self.key, self.token, self._term.lease_ms)
        return self._term.answer(result, asked)

    async def release(self) -> None:
        self._term.valid_until = 0.0
        self._table.release(self.key, self.token)

    async def close(self) -> None:
        await self.release()


class RedisLease:
    """One key holding ``token`` with a ttl of ``lease_ms``; renew well within it.

    ``client`` is a Redis client or a Redis Cluster client; ``owns_client``
    says whether :meth:`close` closes it; ``retries`` counts failover retries.
    """

    def __init__(
        self,
        client: Any,
        key: str,
        token: str,
        lease_ms: int,
        *,
        through_failover: bool = False,
        owns_client: bool = True,
        retries: Counter | None = None,
    ) -> None:
        self._client = client
        self.key = key
        self.token = token
        self._term = _Term(lease_ms)
        self._lease_ms = lease_ms
        self._retry = through_failover
        self._owns_client = owns_client
        self._retries = retries
        self._renew = script_for(client, RENEW)
        self._release = script_for(client, RELEASE)

    @classmethod
    def on_cluster(cls, bus: RedisClusterBus, key: str, token: str, lease_ms: int) -> RedisLease:
        """On the Redis Cluster of ``bus``, with a command client of its own."""
        return cls(
            bus.command_client(),
            key,
            token,
            lease_ms,
            through_failover=True,
            retries=bus.pipes.retries,
        )

    async def _call(self, call: Callable[[], Awaitable[T]], started: float) -> T:
        if not self._retry:
            return await call()
        # Past one lease term there is nothing left to keep: any holder's key lapsed.
        deadline = started + self._lease_ms / 1000
        return await through_failover(call, deadline, retries=self._retries)

    @property
    def valid_until(self) -> float:
        return self._term.valid_until

    async def renew(self) -> LeaseState:
        asked = time.monotonic()
        args: list[Any] = [self.token, self._lease_ms]
        try:
            result = int(await self._call(lambda: self._renew(keys=[self.key], args=args), asked))
        except BaseException:
            self._term.valid_until = 0.0
            raise
        return self._term.answer(result, asked)

    async def release(self) -> None:
        self._term.valid_until = 0.0
        release = self._release
        await self._call(lambda: release(keys=[self.key], args=[self.token]), time.monotonic())

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()
