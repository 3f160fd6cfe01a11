"""Redis pub/sub bus: envelopes cross nodes through one Redis.

One connection publishes, one dedicated connection subscribes, and a reader
task hands each message to the node's handler in arrival order. Each topic is
one channel (``docs/cluster.md``, "Channel layout"), so a node receives only
the game events its own clients watch.

When the subscriber connection drops, the bus says so (``connected`` is
False, ``/readyz`` turns 503), retries with jittered backoff, subscribes every
current topic again, and then calls the reconnect callbacks *before* it
delivers any message of the new connection: the node reloads what it may have
missed from a state that is already covered by the new subscriptions. While
Redis is away, ``publish`` still delivers to this node's own subscribers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from server.bus.base import BusDown, MessageHandler
from server.redis.client import RedisUnavailable, make_client, subscriber_connection
from server.redis.keys import channel_for
from server.redis.subscriber import CONFIRM_TIMEOUT_S, Push, Subscriber
from server.runtime.backoff import Backoff
from server.runtime.metrics import Counter, Registry
from server.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

ReconnectCallback = Callable[[], None]
"""Called on the reader task after a reconnect, before any new message is delivered."""


class BusUnavailable(RedisUnavailable):
    """The bus's Redis could not be reached at start-up within the allowed time."""


class LocalDelivery:
    """What both Redis buses do with their own node's handler.

    Subclasses set ``_handler`` and ``_topics`` and call :meth:`_count_on`; a
    publish that cannot reach Redis still reaches this node's subscribers, on a
    later loop turn as a network bus would deliver it.
    """

    _handler: MessageHandler | None
    _topics: set[str]
    _local_only: Counter

    def _count_on(self, registry: Registry) -> None:
        """What both buses report: local-only publishes, and whether they are connected."""
        self._local_only = registry.counter(
            "ap_bus_local_only_publishes_total",
            "Publishes delivered to this node only, because Redis was unreachable",
        )
        registry.gauge("ap_bus_connected", "1 while the Redis bus is connected", self._gauge)

    def _gauge(self) -> float:
        return 1.0 if self.connected else 0.0

    @property
    def connected(self) -> bool:
        raise NotImplementedError

    def _deliver_here_only(self, topic: str, data: bytes) -> None:
        self._local_only.inc()
        if topic in self._topics:
            asyncio.get_running_loop().call_soon(self._deliver_local, topic, data)

    def _deliver_local(self, topic: str, data: bytes) -> None:
        if topic in self._topics:
            self._call_handler(topic, data)

    def _call_handler(self, topic: str, data: bytes) -> None:
        handler = self._handler
        if handler is None:
            return
        try:
            handler(topic, data)
        except Exception:
            log.exception("bus handler failed on %s", topic)


class RedisBus(LocalDelivery):
    sharded = False

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 30.0,
        keepalive: float = 5.0,
        max_backoff: float = 2.0,
        name: str | None = None,
        metrics: Registry | None = None,
    ) -> None:
        registry = metrics or Registry()
        self._count_on(registry)
        self._reconnects = registry.counter(
            "ap_bus_reconnects_total", "Times the Redis subscriber reconnected"
        )
        self.url = url
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._max_backoff = max_backoff
        # One retry: a pooled connection that died with the last Redis fails once.
        self._client = make_client(url, retries=1)
        # The subscriber never reconnects by itself: a failure must surface so
        # that the reader starts a fresh connection and the node learns it missed
        # messages. Named (``ap-sub:<node>``) so an operator, or a test, can find
        # it in CLIENT LIST.
        self._sub_name = f"ap-sub:{name}" if name else None
        self._handler: MessageHandler | None = None
        self._topics: set[str] = set()
        self._by_channel: dict[bytes, str] = {}
        self._subscriber: Subscriber | None = None  # set while attached and subscribed
        self._attached = asyncio.Event()
        self._connected_since = 0.0
        self._ever_attached = False
        self._reconnected_at: float | None = None
        self._callbacks: list[ReconnectCallback] = []
        self._reader: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def connected(self) -> bool:
        return self._attached.is_set()

    @property
    def serving(self) -> bool:
        """Without its one Redis a node reaches no other node: not ready."""
        return self.connected

    @property
    def connected_since(self) -> float:
        """``time.monotonic()`` of the current connection; meaningless while disconnected."""
        return self._connected_since

    @property
    def reconnected_at(self) -> float | None:
        """``time.monotonic()`` of the latest reconnect; None before the first one."""
        return self._reconnected_at

    def on_reconnect(self, callback: ReconnectCallback) -> None:
        """Call ``callback`` after every reconnect (not the first connect)."""
        self._callbacks.append(callback)

    def command_client(self) -> aioredis.Redis:
        """A client of its own for a caller's commands and scripts (presence)."""
        return make_client(self.url, retries=1)

    # --- lifecycle ----------------------------------------------------------

    async def start(self, handler: MessageHandler) -> None:
        """Start the reader and wait for the first connection (BusUnavailable if none)."""
        self._handler = handler
        self._closing = False
        self._reader = asyncio.create_task(self._run(), name="redis-bus-reader")
        try:
            await asyncio.wait_for(self._attached.wait(), self._connect_timeout)
        except TimeoutError:
            await self.close()
            raise BusUnavailable(
                f"Redis at {self.url} did not answer within {self._connect_timeout:g}s"
            ) from None

    async def close(self) -> None:
        self._closing = True
        if self._reader is not None:
            await cancel_and_wait(self._reader)
            self._reader = None
        self._handler = None
        self._topics.clear()
        self._by_channel.clear()
        with contextlib.suppress(Exception):
            await self._client.aclose()

    # --- publish and subscribe ----------------------------------------------

    async def publish(self, topic: str, data: bytes, *, local_fallback: bool = True) -> None:
        if self.connected:
            try:
                await self._client.publish(channel_for(topic), data)
                return
            except (RedisError, OSError) as exc:
                if not local_fallback:
                    raise BusDown(f"Redis publish on {topic} failed: {exc}") from exc
                log.warning("publish on %s failed, delivering on this node only: %s", topic, exc)
        if not local_fallback:
            raise BusDown(f"the Redis bus is disconnected; {topic} not published")
        self._deliver_here_only(topic, data)

    async def subscribe(self, topics: Iterable[str]) -> None:
        """Subscribe; when connected, return once Redis has taken the subscription."""
        added: list[str] = []
        for topic in topics:
            if topic not in self._topics:
                self._topics.add(topic)
                self._by_channel[channel_for(topic).encode()] = topic
                added.append(topic)
        subscriber = self._subscriber
        if subscriber is None:
            return  # a reconnect subscribes every current topic
        try:
            if added:
                subscriber.send(("SUBSCRIBE", *[channel_for(topic) for topic in added]))
            # Even with nothing new, wait: a SUBSCRIBE sent by another caller
            # for these topics is confirmed once this barrier is.
            await subscriber.barrier()
        except TimeoutError:
            log.warning("Redis did not confirm a subscription within %gs", CONFIRM_TIMEOUT_S)
        except (RedisError, OSError) as exc:
            log.debug("subscribe deferred to the next reconnect: %s", exc)

    async def unsubscribe(self, topics: Iterable[str]) -> None:
        removed: list[str] = []
        for topic in topics:
            if topic in self._topics:
                self._topics.discard(topic)
                self._by_channel.pop(channel_for(topic).encode(), None)
                removed.append(topic)
        subscriber = self._subscriber
        if not removed or subscriber is None:
            return
        # Messages already on their way are dropped: the channel is out of _by_channel.
        with contextlib.suppress(RedisError, OSError):
            subscriber.send(("UNSUBSCRIBE", *[channel_for(topic) for topic in removed]))

    # --- the reader ---------------------------------------------------------

    def recheck(self, topic: str) -> None:
        """Subscribe every topic anew on a fresh connection, as after a loss, then run
        the reconnect callbacks (presence reload, held streams checked).

        For a loss no connection reported: a check found events committed on
        ``topic`` that this node never heard, so the subscription may be silent
        with its connection up (one connection holds every topic here)."""
        subscriber = self._subscriber
        if subscriber is not None and not self._closing:
            subscriber.drop(f"nothing heard on {topic} that Redis committed")

    async def _run(self) -> None:
        retrying = Backoff(first=0.1, cap=self._max_backoff).start()
        while not self._closing:
            subscriber = Subscriber(
                subscriber_connection(self.url, client_name=self._sub_name),
                self._dispatch,
                keepalive=self._keepalive,
                name="bus",
            )
            try:
                await self._attach(subscriber)
                retrying.reset()
                if self._ever_attached:
                    self._reconnects.inc()
                    self._reconnected_at = self._connected_since
                    log.info("Redis bus reconnected; %d topics subscribed", len(self._topics))
                    for callback in self._callbacks:
                        try:
                            callback()
                        except Exception:
                            log.exception("reconnect callback failed")
                self._ever_attached = True
                subscriber.release()
                await subscriber.run()
            except Exception as exc:  # any failure means: start over on a fresh connection
                if retrying.failures == 0:
                    log.warning("Redis bus connection lost: %s", exc or type(exc).__name__)
            finally:
                self._detach()
                await subscriber.close()
            await retrying.wait()

    async def _attach(self, subscriber: Subscriber) -> None:
        """Subscribe every topic on a fresh connection and wait for Redis to confirm."""
        subscribed = set(self._topics)
        await subscriber.open()
        if subscribed:
            subscriber.send(("SUBSCRIBE", *[channel_for(topic) for topic in subscribed]))
        try:
            await subscriber.barrier()
        except TimeoutError:
            raise TimeoutError("Redis did not confirm the subscriptions") from None
        self._subscriber = subscriber
        self._connected_since = time.monotonic()
        self._attached.set()
        # Topics changed while subscribing: bring Redis in line without waiting.
        added = self._topics - subscribed
        removed = subscribed - self._topics
        if added:
            subscriber.send(("SUBSCRIBE", *[channel_for(topic) for topic in added]))
        if removed:
            subscriber.send(("UNSUBSCRIBE", *[channel_for(topic) for topic in removed]))

    def _detach(self) -> None:
        self._subscriber = None
        self._attached.clear()

    def _dispatch(self, push: Push) -> None:
        if push[0] == b"message":
            topic = self._by_channel.get(push[1])
            if topic is not None:
                self._call_handler(topic, push[2])
