"""One writer at a time per game, across the cluster: what keeps chat in order.

Chat must store comments in the same order as their events' stream positions.
The append (DynamoDB) and the publish (the bus, which assigns the position) are
two systems, so the service holds a per-game lock around both: whoever appends
next also publishes next. On one node an ``asyncio.Lock`` per game is enough;
in a cluster the game's lease (:mod:`server.coordination.lease`) is taken as
well, renewed while held, and released only by its holder.

The lease is what bounds the damage of a holder that stalls: past the lease,
another node may go ahead. The holder therefore checks and extends its lease
as it publishes: the last append of a post carries the lease as a ``Fence``,
which the append script checks and releases in the same step (one round trip,
and no other writer can append between them); ``ap_game_lock_lost_total``
counts the rare case where it had lost it, in which the order of those two
comments may differ between the item and the stream. (``confirm`` checks and
extends on its own, for a holder with nothing to append.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

from redis.exceptions import RedisError

from server.bus.streams import Fence
from server.coordination.lease import (
    Lease,
    LeaseState,
    LeaseTable,
    MemoryLease,
    RedisLease,
    new_token,
)
from server.redis.client import command_client_for
from server.runtime.backoff import Backoff
from server.runtime.metrics import Counter, Registry

log = logging.getLogger(__name__)

LEASE_MS = 10_000
"""A holder that stalls this long loses the game to the next writer."""

WAIT_SECONDS = 20.0
"""Longest wait for a game's lock before the post is refused as ``unavailable``."""

ACQUIRE_BACKOFF = Backoff(first=0.002, cap=0.005)
"""Between two tries at a game's lease held by another node. A busy game's nodes
take turns, each waiting out the other's batch: every millisecond between the
release and the next try is added to every comment waiting on that node."""


class LockUnavailable(Exception):
    """The lock could not be taken in time, or Redis could not be reached."""


class Held(Protocol):
    async def confirm(self) -> bool:
        """Check (and extend) that this holder still has the game; False if lost."""

    def fence(self) -> Fence | None:
        """The lease for the game's last append to check and release in the same
        step (one round trip for both), or None where the lock is a local one."""


class GameLocks(Protocol):
    def hold(self, key: str) -> contextlib.AbstractAsyncContextManager[Held]:
        """Hold ``key`` exclusively for the ``async with`` body."""

    async def close(self) -> None: ...


class _LocalLocks:
    """Per-key asyncio locks, dropped when nobody holds or waits for them."""

    def __init__(self, timeouts: Counter) -> None:
        self._timeouts = timeouts
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str, deadline: float) -> AsyncIterator[None]:
        """Hold ``key``; LockUnavailable if it is not free by ``deadline`` (monotonic)."""
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            try:
                async with asyncio.timeout_at(_loop_time(deadline)):
                    await lock.acquire()
            except TimeoutError:
                self._timeouts.inc()
                raise LockUnavailable("the game is busy; try again") from None
            try:
                yield
            finally:
                lock.release()
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


def _loop_time(deadline: float) -> float:
    """A ``time.monotonic()`` deadline on the event loop's clock."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


def lock_key(key: str) -> str:
    """Beside the game's channel, in the same hash tag (one Redis Cluster slot)."""
    return "ap:{game:" + key + "}:chat-lock"


class _Held:
    """One hold of a game: its lease, renewed in the background while it lasts."""

    def __init__(self, lease: Lease, lost: Counter, fenced: bool) -> None:
        self._lease = lease
        self._lost = lost
        self._fenced = fenced
        self._fence: Fence | None = None
        self.lost = False

    def fence(self) -> Fence | None:
        if self._fenced and self._fence is None:
            self._fence = Fence(self._lease.key, self._lease.token, release=True)
        return self._fence

    def released_by_fence(self) -> bool:
        """The append under the fence released the lease (it ran, and it was ours);
        a lease the renewer took again meanwhile is this holder's to release."""
        fence = self._fence
        if fence is None or not fence.applied:
            return False
        if fence.lost:
            self._lost.inc()
            log.warning("chat lease %s expired before the publish", self._lease.key)
            return False
        return not self.lost

    async def extend(self) -> bool:
        try:
            state = await self._lease.renew()
        except (RedisError, OSError) as exc:
            log.warning("could not extend the chat lease %s: %s", self._lease.key, exc)
            return not self.lost
        if state is not LeaseState.RENEWED:
            # LOST: another holder has it; ACQUIRED: it lapsed meanwhile and
            # was taken again, so another node may have gone ahead in between.
            self.lost = True
        return not self.lost

    async def confirm(self) -> bool:
        held = await self.extend()
        if not held:
            self._lost.inc()
            log.warning("chat lease %s expired before the publish", self._lease.key)
        return held

    async def renew_forever(self, every: float) -> None:
        while not self.lost:
            await asyncio.sleep(every)
            await self.extend()


class _LeasedGameLocks:
    """A local lock per game first (so a node sends one contender to its lease
    store), then the game's lease, renewed while held and released after: by
    the holder's last append (``Held.fence``) where the lease lives in Redis."""

    _fenced = False

    def __init__(self, *, lease_ms: int | None, wait: float, metrics: Registry | None) -> None:
        registry = metrics or Registry()
        self._lost = registry.counter(
            "ap_game_lock_lost_total", "Per-game chat leases found expired before the publish"
        )
        self._timeouts = registry.counter(
            "ap_game_lock_timeouts_total", "Per-game chat locks not obtained within the wait"
        )
        self._lease_ms = lease_ms
        self._wait = wait
        self._local = _LocalLocks(self._timeouts)

    def _lease(self, key: str, token: str) -> Lease:
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[Held]:
        deadline = time.monotonic() + self._wait
        async with self._local.hold(key, deadline):
            lease = self._lease(lock_key(key), new_token("chat"))
            await self._acquire(lease, deadline)
            held = _Held(lease, self._lost, self._fenced)
            renewer = None
            if self._lease_ms is not None:
                every = self._lease_ms / 3000
                renewer = asyncio.create_task(held.renew_forever(every), name=f"chat-lease:{key}")
            try:
                yield held
            finally:
                if renewer is not None:
                    renewer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await renewer
                try:
                    if not held.released_by_fence():
                        await lease.release()
                except (RedisError, OSError) as exc:
                    log.warning("could not release %s (it expires by itself): %s", lease.key, exc)

    async def _acquire(self, lease: Lease, deadline: float) -> None:
        retrying = ACQUIRE_BACKOFF.start(deadline=deadline)
        while True:
            try:
                if await lease.renew() is not LeaseState.LOST:
                    return
            except (RedisError, OSError) as exc:
                raise LockUnavailable(f"Redis refused the chat lock: {exc}") from exc
            if not await retrying.wait():
                self._timeouts.inc()
                raise LockUnavailable("the game is busy; try again")


class MemoryGameLocks(_LeasedGameLocks):
    """The embedded default: one process, so its leases never lapse and the
    local lock is the whole story."""

    def __init__(self, *, wait: float = WAIT_SECONDS, metrics: Registry | None = None) -> None:
        super().__init__(lease_ms=None, wait=wait, metrics=metrics)
        self._table = LeaseTable()

    def _lease(self, key: str, token: str) -> Lease:
        return MemoryLease(key, token, table=self._table)

    async def close(self) -> None:
        return None


class RedisGameLocks(_LeasedGameLocks):
    """Leases in Redis (one Redis or a Redis Cluster), shared by every node."""

    _fenced = True

    def __init__(
        self,
        url: str,
        *,
        lease_ms: int = LEASE_MS,
        wait: float = WAIT_SECONDS,
        cluster: bool = False,
        metrics: Registry | None = None,
    ) -> None:
        super().__init__(lease_ms=lease_ms, wait=wait, metrics=metrics)
        self._client = command_client_for(url, cluster=cluster)

    def _lease(self, key: str, token: str) -> Lease:
        assert self._lease_ms is not None
        return RedisLease(self._client, key, token, self._lease_ms, owns_client=False)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.aclose()
