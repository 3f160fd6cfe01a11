"""Redis Cluster bus: sharded pub/sub, one reader per shard.

Every topic keeps the channel name of :func:`~server.redis.keys.channel_for`;
its hash tag decides the slot, and so the shard (primary) that carries it.
``SPUBLISH`` goes to that shard only, and a node holds one ``SSUBSCRIBE``
connection per primary that owns a slot it listens to.

Why not redis-py's ``RedisCluster.pubsub()``: its ``get_sharded_message``
polls the per-shard connections in turn, each with the timeout given, so a
message waits for every quiet shard polled before it (or the loop spins with
timeout 0), and a shard that hangs delays all the others. It also reconnects
and resubscribes silently, so the node could not learn that it missed
messages. Here each shard has its own reader task, so shards never wait for
one another, and a lost shard is repaired explicitly:

1. ``connected`` turns False (``/readyz`` 503) and a repair task refreshes the
   slot map from the cluster, with jittered backoff, until every channel has a
   live owner (after a failover: the promoted replica);
2. it subscribes each channel on its current owner and waits for the barrier
   (a ``PING`` after the ``SSUBSCRIBE``s, on the same connection);
3. it calls the reconnect callbacks (the node reloads presence and sends fresh
   snapshots), and only then delivers what the new connections received.

Publishing (``SPUBLISH``, and the streams' scripts) goes over one pipelined
connection per primary (:mod:`server.redis.shard_pipes`), routed by the same
slot map, and retries through a failover (up to ``publish_deadline``) instead
of dropping the event; past that it delivers to this node only, as the
single-Redis bus does while Redis is away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError

from server.bus.base import BusDown, MessageHandler
from server.bus.redis_bus import BusUnavailable, LocalDelivery, ReconnectCallback
from server.redis.client import close_pubsub, make_cluster_client, startup_nodes
from server.redis.keys import channel_for
from server.redis.shard_pipes import ShardPipes
from server.runtime.backoff import Backoff
from server.runtime.metrics import Registry
from server.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def _by_slot(channels: Iterable[str]) -> list[list[str]]:
    """One ``SSUBSCRIBE`` may name channels of one slot only."""
    groups: dict[int, list[str]] = defaultdict(list)
    for channel in channels:
        groups[key_slot(channel.encode())].append(channel)
    return list(groups.values())


class _ShardLost(Exception):
    """A shard connection failed or dropped a subscription it should hold."""


class _Shard:
    """One primary's subscription connection and its reader task."""

    def __init__(self, bus: RedisClusterBus, host: str, port: int) -> None:
        self.bus = bus
        self.name = f"{host}:{port}"
        self.redis = aioredis.Redis(
            host=host,
            port=port,
            client_name=bus.client_name,
            socket_connect_timeout=1.0,
            socket_timeout=None,
            health_check_interval=0,
            retry=Retry(NoBackoff(), 0),
        )
        self.pubsub: PubSub | None = None
        self.channels: set[str] = set()
        self.reader: asyncio.Task[None] | None = None
        self.barriers: dict[bytes, asyncio.Future[bool]] = {}
        self.dead = False  # lost: never used again

    @property
    def attached(self) -> bool:
        return self.pubsub is not None

    async def attach(self, channels: set[str]) -> list[dict[str, Any]]:
        """Subscribe ``channels`` on a fresh connection; return what arrived meanwhile."""
        pubsub = self.redis.pubsub()
        try:
            await pubsub.connect()  # type: ignore[no-untyped-call]
            for group in _by_slot(channels):
                await pubsub.ssubscribe(*group)
            token = uuid.uuid4().hex.encode()
            await pubsub.ping(token)
            backlog: list[dict[str, Any]] = []
            async with asyncio.timeout(5.0):
                while True:
                    message = await pubsub.get_message(timeout=5.0)
                    if message is None:
                        continue
                    if message["type"] == "pong" and message["data"] == token:
                        break
                    backlog.append(message)
        except BaseException:
            await close_pubsub(pubsub)
            raise
        # redis-py reconnects a pub/sub connection by itself (in get_message,
        # or after a failed command) and resubscribes silently: messages sent
        # meanwhile would be lost unnoticed. Any reconnect counts as a loss.
        assert pubsub.connection is not None
        pubsub.connection.register_connect_callback(self._reconnected)
        self.pubsub = pubsub
        self.channels = set(channels)
        return backlog

    async def _reconnected(self, connection: object) -> None:
        if self.pubsub is not None:
            self.bus.lost(self, _ShardLost("the connection was re-established"))

    def start_reader(self) -> None:
        if self.pubsub is not None and self.reader is None:
            self.reader = asyncio.create_task(self._read(self.pubsub), name=f"shard-{self.name}")

    async def _read(self, pubsub: PubSub) -> None:
        keepalive = self.bus.keepalive
        last_seen = time.monotonic()
        try:
            while True:
                message = await pubsub.get_message(timeout=keepalive)
                now = time.monotonic()
                if message is None:
                    if now - last_seen > 2 * keepalive:
                        raise TimeoutError("no answer to a keepalive ping")
                    await pubsub.ping()
                    continue
                last_seen = now
                self.dispatch(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.reader = None
            self.bus.lost(self, exc)

    def dispatch(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "smessage":
            self.bus.deliver(message["channel"], message["data"])
        elif kind == "pong":
            future = self.barriers.get(message["data"])
            if future is not None and not future.done():
                future.set_result(True)
        elif kind == "sunsubscribe":
            channel = message["channel"].decode()
            if channel in self.channels:
                # Redis dropped it: its slot moved, or this primary was demoted.
                self.bus.lost(self, _ShardLost(f"the server unsubscribed {channel}"))

    async def change(self, add: set[str], remove: set[str]) -> None:
        """Apply a subscription change on the live connection and wait for Redis to take it."""
        pubsub = self.pubsub
        if pubsub is None:
            raise _ShardLost("not attached")
        self.channels |= add
        self.channels -= remove
        for group in _by_slot(remove):
            await pubsub.sunsubscribe(*group)
        for group in _by_slot(add):
            await pubsub.ssubscribe(*group)
        if add:
            token = uuid.uuid4().hex.encode()
            future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self.barriers[token] = future
            try:
                await pubsub.ping(token)
                await asyncio.wait_for(future, 5.0)
            finally:
                self.barriers.pop(token, None)

    async def close(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None and reader is not asyncio.current_task():
            await cancel_and_wait(reader)
        pubsub, self.pubsub = self.pubsub, None
        for future in self.barriers.values():
            if not future.done():
                future.set_result(False)
        if pubsub is not None:
            await close_pubsub(pubsub)
        with contextlib.suppress(Exception):
            await self.redis.aclose()


class RedisClusterBus(LocalDelivery):
    """The :class:`~server.bus.base.Bus` over a Redis Cluster (``--redis-cluster-url``)."""

    sharded = True
    """Scripts publish with ``SPUBLISH`` (``server.presence.scripts.for_bus``)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 30.0,
        keepalive: float = 5.0,
        max_backoff: float = 1.0,
        publish_deadline: float = 10.0,
        name: str | None = None,
        metrics: Registry | None = None,
    ) -> None:
        startup_nodes(url)  # fail on a bad URL now, not in the reader
        registry = metrics or Registry()
        self._count_on(registry)
        self._shard_losses = registry.counter(
            "ap_bus_shard_losses_total",
            "Times a Redis Cluster shard subscription connection was lost",
        )
        self.url = url
        # Named (``ap-sub:<node>``) so an operator, or a test, can find it in CLIENT LIST.
        self.client_name = f"ap-sub:{name}" if name else None
        self.keepalive = keepalive
        self._connect_timeout = connect_timeout
        self._max_backoff = max_backoff
        self.publish_deadline = publish_deadline
        self._client = make_cluster_client(url)
        # Publishes and stream scripts: one pipelined connection per primary,
        # routed by this client's slot map (the one the readers follow).
        self.pipes = ShardPipes(
            self._client, client_name=f"ap-cmd:{name}" if name else None, metrics=registry
        )
        self._handler: MessageHandler | None = None
        self._topics: set[str] = set()
        self._by_channel: dict[bytes, str] = {}
        self._shards: dict[str, _Shard] = {}
        self._home: dict[str, str] = {}  # channel -> name of the shard subscribed to it
        self._lock = asyncio.Lock()  # one subscription change at a time
        self._healthy = asyncio.Event()
        self._connected_since = 0.0
        self._repair: asyncio.Task[None] | None = None
        self._dirty = False  # topics changed while a repair was under way
        self._callbacks: list[ReconnectCallback] = []
        self._closing = False

    @property
    def connected(self) -> bool:
        return self._healthy.is_set()

    @property
    def serving(self) -> bool:
        """Connected, or repairing some shards while others still deliver.

        A shard failing over is lost by every node at once: a 503 from all of
        them would only make the balancer drop every target, while each node
        still serves its clients (that shard's events are late, then repaired
        from history). Only with no live shard at all is a node cut off.
        """
        if self.connected:
            return True
        return (
            not self._closing
            and self._connected_since > 0
            and any(shard.attached and not shard.dead for shard in self._shards.values())
        )

    @property
    def connected_since(self) -> float:
        return self._connected_since

    def on_reconnect(self, callback: ReconnectCallback) -> None:
        """Call ``callback`` after every repair of a lost shard (not the first connect)."""
        self._callbacks.append(callback)

    def command_client(self) -> RedisCluster:
        """A client of its own for a caller's commands and scripts (presence)."""
        return make_cluster_client(self.url)

    def shard_of(self, topic: str) -> str | None:
        """``host:port`` of the shard this node listens to ``topic`` on (tests, metrics)."""
        return self._home.get(channel_for(topic))

    # --- lifecycle ----------------------------------------------------------

    async def start(self, handler: MessageHandler) -> None:
        self._handler = handler
        self._closing = False
        self.pipes.reopen()
        self._repair = asyncio.create_task(self._repair_loop(first=True), name="cluster-bus-repair")
        try:
            await asyncio.wait_for(self._healthy.wait(), self._connect_timeout)
        except TimeoutError:
            await self.close()
            raise BusUnavailable(
                f"Redis Cluster at {self.url} did not answer within {self._connect_timeout:g}s"
            ) from None

    async def close(self) -> None:
        self._closing = True
        self._healthy.clear()
        if self._repair is not None:
            await cancel_and_wait(self._repair)
            self._repair = None
        for shard in list(self._shards.values()):
            await shard.close()
        self._shards.clear()
        self._home.clear()
        self._handler = None
        self._topics.clear()
        self._by_channel.clear()
        await self.pipes.close()
        with contextlib.suppress(Exception):
            await self._client.aclose()

    # --- publish ------------------------------------------------------------

    async def publish(self, topic: str, data: bytes, *, local_fallback: bool = True) -> None:
        channel = channel_for(topic)
        deadline = time.monotonic() + self.publish_deadline
        try:
            slot = key_slot(channel.encode())
            await self.pipes.execute(slot, ("SPUBLISH", channel, data), deadline)
            return
        except (RedisError, RedisClusterException, OSError) as exc:
            if not local_fallback:
                raise BusDown(f"SPUBLISH on {topic} failed: {exc}") from exc
            log.warning("SPUBLISH on %s failed, delivering here only: %s", topic, exc)
        self._deliver_here_only(topic, data)

    # --- subscribe ----------------------------------------------------------

    async def subscribe(self, topics: Iterable[str]) -> None:
        """Subscribe; when connected, return once every owning shard has taken it."""
        added = [t for t in topics if t not in self._topics]
        for topic in added:
            self._topics.add(topic)
            self._by_channel[channel_for(topic).encode()] = topic
        if added:
            await self._changed(added)
        elif self.connected:
            # Another caller may have named these topics a moment ago, its change
            # still under way: like its own, this call returns once it is taken.
            async with self._lock:
                pass

    async def unsubscribe(self, topics: Iterable[str]) -> None:
        removed = [t for t in topics if t in self._topics]
        for topic in removed:
            self._topics.discard(topic)
            self._by_channel.pop(channel_for(topic).encode(), None)
        if removed:
            await self._changed(removed)

    async def _changed(self, topics: list[str]) -> None:
        if self.connected:
            await self._apply([channel_for(t) for t in topics])
        else:
            self._dirty = True  # the repair under way picks them up

    async def _apply(self, channels: list[str]) -> None:
        """Bring the live shards in line for ``channels``; a failure starts a repair."""
        try:
            async with self._lock:
                backlogs = await self._reconcile(channels)
            for shard, backlog in backlogs:
                for message in backlog:
                    shard.dispatch(message)
                shard.start_reader()
        except (RedisError, OSError, TimeoutError, _ShardLost) as exc:
            log.debug("subscription change deferred to the repair: %s", exc)
            self._start_repair(exc)

    async def _reconcile(
        self, changed: Iterable[str] | None = None
    ) -> list[tuple[_Shard, list[dict[str, Any]]]]:
        """Place channels on the primary that owns their slot now: those in
        ``changed`` (a subscription change), or every one (a repair).

        Returns the shards attached by this call with the messages they read
        while attaching; the caller delivers those and starts their readers.
        """
        current = {channel_for(t) for t in self._topics}
        scope = current | set(self._home) if changed is None else set(changed)
        add: dict[str, set[str]] = defaultdict(set)
        remove: dict[str, set[str]] = defaultdict(set)
        owners: dict[str, ClusterNode] = {}
        for channel in scope:
            holder = self._home.get(channel)
            if channel in current:
                node = self._client.get_node_from_key(channel)
                if node is None:
                    raise _ShardLost(f"no primary serves {channel}")
                if holder != node.name:
                    add[node.name].add(channel)
                    owners[node.name] = node
                    if holder is not None:
                        remove[holder].add(channel)
            elif holder is not None:
                remove[holder].add(channel)
        for name, channels in remove.items():
            holding = self._shards[name]
            if channels >= holding.channels and name not in add:
                await self._drop(holding)
            else:
                await holding.change(set(), channels)
                self._unhome(channels)
        attached: list[tuple[_Shard, list[dict[str, Any]]]] = []
        try:
            for name, channels in add.items():
                shard = self._shards.get(name)
                if shard is None:
                    node = owners[name]
                    shard = self._shards[name] = _Shard(self, node.host, int(node.port))
                if shard.attached:
                    await shard.change(channels, set())
                else:
                    attached.append((shard, await shard.attach(channels)))
                for channel in channels:
                    self._home[channel] = name
        except BaseException:
            # Shards attached in this pass have no reader yet: drop them, so
            # that the next pass attaches them afresh instead of trusting them.
            for shard, _ in attached:
                await self._drop(shard)
            raise
        return attached

    async def _drop(self, shard: _Shard) -> None:
        if self._shards.get(shard.name) is shard:
            del self._shards[shard.name]
        self._unhome(shard.channels)
        await shard.close()

    def _unhome(self, channels: Iterable[str]) -> None:
        for channel in channels:
            self._home.pop(channel, None)

    # --- losing and repairing shards ----------------------------------------

    def lost(self, shard: _Shard, exc: BaseException) -> None:
        """Called by a shard whose connection failed (from its reader)."""
        if self._closing or shard.dead:
            return
        shard.dead = True
        self._shard_losses.inc()
        log.warning("Redis Cluster shard %s lost: %s", shard.name, exc or type(exc).__name__)
        if self._shards.get(shard.name) is shard:
            del self._shards[shard.name]
        self._unhome(shard.channels)  # the repair places them again
        asyncio.get_running_loop().create_task(shard.close())
        self._start_repair(exc)

    def recheck(self, topic: str) -> None:
        """Subscribe ``topic``'s shard again on a fresh connection, as after a loss.

        For a loss no connection reported (the presence view check found a delta
        this node never heard): after a whole cluster restart, a subscription
        Redis took while the cluster re-formed was seen to deliver nothing and say
        nothing. The shard is dropped and the repair attaches its channels anew
        on the owners a fresh slot map names, then runs the reconnect callbacks
        (presence reload, held streams checked)."""
        if self._closing or self._handler is None:
            return
        home = self._home.get(channel_for(topic))
        shard = self._shards.get(home) if home is not None else None
        reason = _ShardLost(f"nothing heard on {topic} that Redis committed")
        if shard is None:
            self._start_repair(reason)
        else:
            self.lost(shard, reason)

    def _start_repair(self, exc: BaseException) -> None:
        self._healthy.clear()
        if self._repair is None or self._repair.done():
            self._repair = asyncio.create_task(self._repair_loop(first=False), name="bus-repair")

    async def _repair_loop(self, *, first: bool) -> None:
        """Refresh the slot map and resubscribe until every channel has a live owner."""
        retrying = Backoff(first=0.1, cap=self._max_backoff).start()
        while not self._closing:
            try:
                async with self._lock:
                    self._dirty = False
                    await self._client.initialize()
                    if not first:
                        # The map may still name the dead primary; make the
                        # client ask the cluster again instead of its cache.
                        await self._client.nodes_manager.initialize()
                    backlogs = await self._reconcile()
                    while self._dirty:
                        self._dirty = False
                        backlogs += await self._reconcile()
                    self._connected_since = time.monotonic()
                    self._healthy.set()
                if not first:
                    log.info("Redis Cluster bus repaired; %d topics subscribed", len(self._topics))
                    for callback in self._callbacks:
                        try:
                            callback()
                        except Exception:
                            log.exception("reconnect callback failed")
                for shard, backlog in backlogs:
                    for message in backlog:
                        shard.dispatch(message)
                    shard.start_reader()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if retrying.failures == 0:
                    log.warning("Redis Cluster bus not ready yet: %s", exc or type(exc).__name__)
                # Drop shards that did not attach, so the next pass starts clean.
                for shard in list(self._shards.values()):
                    if not shard.attached:
                        await self._drop(shard)
            await retrying.wait()

    # --- delivery -----------------------------------------------------------

    def deliver(self, channel: bytes, data: bytes) -> None:
        topic = self._by_channel.get(channel)
        if topic is not None:
            self._call_handler(topic, data)
