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
from collections import defaultdict
from collections.abc import Iterable

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError

from server.bus.base import BusDown, MessageHandler
from server.bus.redis_bus import BusUnavailable, LocalDelivery, ReconnectCallback
from server.redis.client import make_cluster_client, startup_nodes
from server.redis.keys import channel_for
from server.redis.pipe import STALL_TIMEOUT_S
from server.redis.shard_pipes import ShardPipes
from server.redis.subscriber import Push, Subscriber
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
    """One primary's subscription connection and the task that reports its loss."""

    def __init__(self, bus: RedisClusterBus, host: str, port: int) -> None:
        self.bus = bus
        self.name = f"{host}:{port}"
        self.host = host
        self.port = port
        self.subscriber: Subscriber | None = None  # set once attached
        self.channels: set[str] = set()
        self.reader: asyncio.Task[None] | None = None
        self.dead = False  # lost: never used again

    @property
    def attached(self) -> bool:
        return self.subscriber is not None

    async def attach(self, channels: set[str]) -> None:
        """Subscribe ``channels`` on a fresh connection; what arrives is held
        until :meth:`start_reader`."""
        connection = Connection(
            host=self.host,
            port=self.port,
            client_name=self.bus.client_name,
            socket_connect_timeout=1.0,
            socket_timeout=5.0,  # the handshake's; the subscriber reads without one
            retry=Retry(NoBackoff(), 0),
        )
        subscriber = Subscriber(
            connection, self.dispatch, keepalive=self.bus.keepalive, name=self.name
        )
        try:
            await subscriber.open()
            for group in _by_slot(channels):
                subscriber.send(("SSUBSCRIBE", *group))
            await subscriber.barrier()
        except BaseException:
            await subscriber.close()
            raise
        self.subscriber = subscriber
        self.channels = set(channels)

    def start_reader(self) -> None:
        """Deliver what was held, then every message as it comes; report a loss."""
        subscriber = self.subscriber
        if subscriber is not None and self.reader is None:
            subscriber.release()
            self.reader = asyncio.create_task(self._watch(subscriber), name=f"shard-{self.name}")

    async def _watch(self, subscriber: Subscriber) -> None:
        try:
            await subscriber.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.reader = None
            self.bus.lost(self, exc)

    def dispatch(self, push: Push) -> None:
        kind = push[0]
        if kind == b"smessage":
            self.bus.deliver(push[1], push[2])
        elif kind == b"sunsubscribe":
            channel = push[1].decode()
            if channel in self.channels:
                # Redis dropped it: its slot moved, or this primary was demoted.
                self.bus.lost(self, _ShardLost(f"the server unsubscribed {channel}"))

    async def change(self, add: set[str], remove: set[str]) -> None:
        """Apply a subscription change on the live connection and wait for Redis to take it."""
        subscriber = self.subscriber
        if subscriber is None:
            raise _ShardLost("not attached")
        self.channels |= add
        self.channels -= remove
        for group in _by_slot(remove):
            subscriber.send(("SUNSUBSCRIBE", *group))
        for group in _by_slot(add):
            subscriber.send(("SSUBSCRIBE", *group))
        if add:
            await subscriber.barrier()

    async def close(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None and reader is not asyncio.current_task():
            await cancel_and_wait(reader)
        subscriber, self.subscriber = self.subscriber, None
        if subscriber is not None:
            await subscriber.close()


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
        stall_timeout: float = STALL_TIMEOUT_S,
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
            self._client,
            client_name=f"ap-cmd:{name}" if name else None,
            stall_timeout=stall_timeout,
            metrics=registry,
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
                attached = await self._reconcile(channels)
            for shard in attached:
                shard.start_reader()
        except (RedisError, OSError, TimeoutError, _ShardLost) as exc:
            log.debug("subscription change deferred to the repair: %s", exc)
            self._start_repair(exc)

    async def _reconcile(self, changed: Iterable[str] | None = None) -> list[_Shard]:
        """Place channels on the primary that owns their slot now: those in
        ``changed`` (a subscription change), or every one (a repair).

        Returns the shards attached by this call, their messages held; the
        caller starts their readers, which deliver them.
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
        attached: list[_Shard] = []
        try:
            for name, channels in add.items():
                shard = self._shards.get(name)
                if shard is None:
                    node = owners[name]
                    shard = self._shards[name] = _Shard(self, node.host, int(node.port))
                if shard.attached:
                    await shard.change(channels, set())
                else:
                    await shard.attach(channels)
                    attached.append(shard)
                for channel in channels:
                    self._home[channel] = name
        except BaseException:
            # Shards attached in this pass have no reader yet: drop them, so
            # that the next pass attaches them afresh instead of trusting them.
            for shard in attached:
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
                    attached = await self._reconcile()
                    while self._dirty:
                        self._dirty = False
                        attached += await self._reconcile()
                    self._connected_since = time.monotonic()
                    self._healthy.set()
                if not first:
                    log.info("Redis Cluster bus repaired; %d topics subscribed", len(self._topics))
                    for callback in self._callbacks:
                        try:
                            callback()
                        except Exception:
                            log.exception("reconnect callback failed")
                for shard in attached:
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
