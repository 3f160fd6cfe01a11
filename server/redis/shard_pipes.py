"""Commands to a Redis Cluster over one pipelined connection per primary.

redis-py's ``RedisCluster`` client spends more CPU per command than the
command costs Redis (slot, routing policy, node lookup, a pooled connection
taken and given back), and a game event is two commands on a cluster. Here a
command goes to the primary that owns its slot in the slot map of the bus's
own ``RedisCluster`` client (the one its per-shard readers follow), over that
primary's single :class:`~server.redis.pipe.Pipe`: a turn's commands in one
write, replies in order, so commands to one slot also run in the order they
were issued.

Errors are handled the way ``RedisCluster`` would, explicitly:

- ``MOVED`` (a slot moved for good): update that slot in the map and resend;
- ``ASK`` (a slot being migrated, this key already gone): ``ASKING`` and the
  command on the target, back to back on its connection;
- ``TRYAGAIN``/``CLUSTERDOWN``, or a lost or refused connection (a primary
  killed, its replica not promoted yet): re-read the slot map and resend every
  ``FAILOVER_RETRY_S`` until the deadline (``FAILOVER_BACKOFF``).

A command whose connection died after it was written may have run; it is
resent like the one ``RedisCluster`` (and ``through_failover``) would resend.
That is safe for what goes through here: a stream append carries its event's
name, and a repeat returns the position the first run took
(``server/bus/redis_streams.py``); a ``SPUBLISH`` resent reaches nodes that
drop what they already hold by its position.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from server.redis.pipe import STALL_TIMEOUT_S, Pipe
from server.redis.scripts import Script
from server.runtime.backoff import Backoff, Retrying
from server.runtime.metrics import Registry

log = logging.getLogger(__name__)

FAILOVER_RETRY_S = 0.1
FAILOVER_BACKOFF = Backoff(first=FAILOVER_RETRY_S, cap=FAILOVER_RETRY_S, jitter=0.0)
"""A failover is polled at a steady pace: the promotion's end is what matters, not load."""

_TRANSIENT = (
    RedisClusterException,  # no slot map yet, or a slot not covered
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    TryAgainError,
    ClusterDownError,
)


class ShardPipes:
    """Route commands by slot to per-primary :class:`~server.redis.pipe.Pipe` connections."""

    def __init__(
        self,
        cluster: RedisCluster,
        *,
        client_name: str | None = None,
        stall_timeout: float = STALL_TIMEOUT_S,
        metrics: Registry | None = None,
    ) -> None:
        registry = metrics or Registry()
        self.retries = registry.counter(
            "ap_bus_failover_retries_total",
            "Redis Cluster commands (SPUBLISH, stream appends, scripts) retried during a failover",
        )
        self.ordered_drops = registry.counter(
            "ap_bus_ordered_publish_drops_total",
            "Redis Cluster publishes given up after the failover deadline (ap:{games})",
        )
        self._cluster = cluster  # its slot map; the bus refreshes it on every repair
        self._client_name = client_name
        self._stall_timeout = stall_timeout
        self._pipes: dict[str, Pipe] = {}
        self._ordered: dict[str, _OrderedPublisher] = {}
        self._closing = False

    def _pipe(self, host: str, port: int) -> Pipe:
        name = f"{host}:{port}"
        pipe = self._pipes.get(name)
        if pipe is None or pipe.dead:
            connection = Connection(
                host=host,
                port=port,
                client_name=self._client_name,
                socket_connect_timeout=1.0,
                socket_timeout=None,  # stalls are caught by the pipe's watchdog
                retry=Retry(NoBackoff(), 0),
            )
            pipe = self._pipes[name] = Pipe(connection, name, self._stall_timeout)
        return pipe

    def _pipe_for(self, slot: int) -> Pipe:
        try:
            node = self._cluster.nodes_manager.get_node_from_slot(slot)
        except KeyError:  # not in the map (yet): retried after a refresh
            raise SlotNotCoveredError(f"slot {slot} has no known primary") from None
        return self._pipe(node.host, int(node.port))

    async def start(self) -> None:
        """Read the slot map (once per client) before the first command."""
        self._closing = False
        await self._cluster.initialize()

    def reopen(self) -> None:
        """Usable again after :meth:`close` (a bus started again)."""
        self._closing = False

    async def execute(self, slot: int, args: tuple[Any, ...], deadline: float) -> Any:
        """Run one command on the primary of ``slot``, through redirects and failovers
        until ``deadline`` (``time.monotonic()``)."""
        retrying: Retrying | None = None
        while True:
            try:
                return await self._pipe_for(slot).submit(args)[0]
            except MovedError as exc:
                await self._cluster.nodes_manager.move_slot(exc)
                error: Exception = exc
            except AskError as exc:
                try:
                    asking, reply = self._pipe(exc.host, exc.port).submit(("ASKING",), args)
                    await asking
                    return await reply
                except MovedError as moved:  # the migration finished meanwhile
                    await self._cluster.nodes_manager.move_slot(moved)
                    error = moved
                except _TRANSIENT as transient:
                    error = transient
            except _TRANSIENT as exc:
                error = exc
            if self._closing:
                raise error
            if isinstance(error, MovedError):
                # The map is right again: resend at once, while there is time.
                if time.monotonic() >= deadline:
                    raise error
                self.retries.inc()
                continue
            if retrying is None:
                retrying = FAILOVER_BACKOFF.start(deadline=deadline)
            delay = retrying.next_delay()
            if delay is None:
                raise error
            self.retries.inc()
            await asyncio.sleep(delay)
            with contextlib.suppress(RedisError, RedisClusterException, OSError):
                await self._cluster.nodes_manager.initialize()

    async def script(
        self, slot: int, script: Script, keys: Sequence[Any], args: Sequence[Any], deadline: float
    ) -> Any:
        """``EVALSHA``, and ``EVAL`` when that primary lacks the script (see ``ShardScript``)."""
        try:
            return await self.execute(slot, script.command(keys, args), deadline)
        except NoScriptError:
            return await self.execute(slot, script.command(keys, args, cached=False), deadline)

    async def send_once(self, slot: int, commands: list[tuple[Any, ...]]) -> list[bool]:
        """Send ``commands`` back to back to the primary of ``slot``; which succeeded."""
        try:
            futures = self._pipe_for(slot).submit(*commands)
        except _TRANSIENT:
            return [False] * len(commands)
        out = []
        for future in futures:
            try:
                await future
                out.append(True)
            except (RedisError, OSError):
                out.append(False)
        return out

    def publish_in_order(self, slot: int, channel: str, message: bytes, deadline_s: float) -> None:
        """``SPUBLISH`` without waiting for it, in the order of the calls.

        For ``ap:{games}`` after a game's ``APPEND``: called as each script's
        reply arrives, so a game's events go out in offset order, and still do
        when a failover makes some of them wait for a retry.
        """
        publisher = self._ordered.get(channel)
        if publisher is None:
            publisher = self._ordered[channel] = _OrderedPublisher(self, slot, channel)
        publisher.add(message, time.monotonic() + deadline_s)

    async def close(self) -> None:
        self._closing = True
        for publisher in list(self._ordered.values()):
            await publisher.close()
        self._ordered.clear()
        for pipe in list(self._pipes.values()):
            await pipe.close()
        self._pipes.clear()


class _OrderedPublisher:
    """One channel's fire-and-forget ``SPUBLISH``es, sent and retried in call order."""

    def __init__(self, pipes: ShardPipes, slot: int, channel: str) -> None:
        self._pipes = pipes
        self._slot = slot
        self._channel = channel
        self._queue: deque[tuple[bytes, float]] = deque()
        self._task: asyncio.Task[None] | None = None

    def add(self, message: bytes, deadline: float) -> None:
        self._queue.append((message, deadline))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name=f"publish-{self._channel}")

    async def _drain(self) -> None:
        while self._queue:
            batch = list(self._queue)
            self._queue.clear()
            sent = await self._pipes.send_once(
                self._slot, [("SPUBLISH", self._channel, message) for message, _ in batch]
            )
            # Only a batch's tail fails (one connection, one slot): resend the
            # failed ones one by one, in order, before anything newer goes out.
            for (message, deadline), ok in zip(batch, sent, strict=True):
                if ok:
                    continue
                try:
                    args = ("SPUBLISH", self._channel, message)
                    await self._pipes.execute(self._slot, args, deadline)
                except (RedisError, OSError) as exc:
                    self._pipes.ordered_drops.inc()
                    log.warning("SPUBLISH on %s given up: %s", self._channel, exc)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._task, 1.0)
