"""The Bus contract: one suite over the in-process bus and the Redis bus.

What every bus promises (``server/bus/base.py``):

- ``publish`` reaches every bus subscribed to the topic, the publisher included,
  once, with the bytes unchanged;
- messages of one topic arrive in publish order, and a publish that returned
  arrives before any later one on the same topic or in the same Redis Cluster slot
  (the tests use that as a barrier, :func:`beside`). Across slots there is no such
  order: a Redis Cluster's shards are separate connections, and a later publish to
  another shard may arrive first;
- nothing arrives for topics not subscribed, or after ``unsubscribe`` or
  ``close``; there is no replay of what was published before ``subscribe``.

The Redis bus runs against ``AP_TEST_REDIS_URL`` or a ``redis-server`` the
session starts, the Redis Cluster bus against the session's six-instance
cluster; each test uses topics of its own, so tests never see each other.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest
from redis.crc import key_slot

from loadtest.harness.redis_cluster import RedisCluster
from server.bus import Bus, MemoryBus, MemoryHub
from server.bus.redis_bus import RedisBus
from server.bus.redis_cluster_bus import RedisClusterBus
from server.redis.keys import channel_for
from tests.services import redis_url_for_tests


@dataclass
class Receiver:
    """A started bus and everything it has delivered."""

    bus: Bus
    got: list[tuple[str, bytes]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, topic: str, data: bytes) -> None:
        self.got.append((topic, data))
        self._changed.set()

    def on(self, topic: str) -> list[bytes]:
        return [data for t, data in self.got if t == topic]

    async def wait_for(self, predicate: Callable[[], bool], within: float = 5.0) -> None:
        async with asyncio.timeout(within):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

    async def wait_count(self, topic: str, count: int) -> None:
        await self.wait_for(lambda: len(self.on(topic)) >= count)


BusFactory = Callable[[], Awaitable[Receiver]]


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_url_for_tests() as url:
        yield url


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def new_bus(request: pytest.FixtureRequest) -> AsyncIterator[BusFactory]:
    """Makes started buses that share one backbone (a MemoryHub, or one Redis)."""
    receivers: list[Receiver] = []
    hub = MemoryHub()

    async def make() -> Receiver:
        bus: Bus
        if request.param == "memory":
            bus = MemoryBus(hub)
        elif request.param == "redis-cluster":
            cluster: RedisCluster = request.getfixturevalue("shared_redis_cluster")
            bus = RedisClusterBus(cluster.url)
        else:
            bus = RedisBus(request.getfixturevalue("redis_url"))
        receiver = Receiver(bus)
        await bus.start(receiver)
        receivers.append(receiver)
        return receiver

    yield make
    for receiver in receivers:
        await receiver.bus.close()


@pytest.fixture
def topic() -> Callable[[str], str]:
    """Topic names unique to this test."""
    prefix = uuid.uuid4().hex[:8]
    return lambda name: f"{prefix}-{name}"


def beside(topic: str, name: str = "marker") -> str:
    """Another topic in ``topic``'s Redis Cluster slot, for a barrier behind it.

    A channel's hash tag runs from its first ``{`` to the first ``}`` after it:
    ``ap:{t}marker}`` hashes as ``ap:{t}`` does, so on a Redis Cluster both travel
    on the same shard's connection, in the order they were published."""
    assert "{" not in topic and "}" not in topic, topic
    marker = f"{topic}}}{name}"
    assert key_slot(channel_for(marker).encode()) == key_slot(channel_for(topic).encode())
    return marker


async def test_a_started_bus_is_connected(new_bus: BusFactory) -> None:
    receiver = await new_bus()
    assert receiver.bus.connected


async def test_publish_reaches_every_subscriber_and_the_publisher(
    new_bus: BusFactory, topic: Callable[[str], str]
) -> None:
    a, b, c = await new_bus(), await new_bus(), await new_bus()
    t = topic("t")
    marker = beside(t)
    await a.bus.subscribe([t, marker])
    await b.bus.subscribe([t, marker])
    await c.bus.subscribe([marker])
    await a.bus.publish(t, b"hello")
    await a.bus.publish(marker, b"m")
    for receiver in (a, b, c):
        await receiver.wait_count(marker, 1)
    assert a.got == [(t, b"hello"), (marker, b"m")]
    assert b.got == [(t, b"hello"), (marker, b"m")]
    assert c.got == [(marker, b"m")]


async def test_a_publisher_that_does_not_subscribe_gets_nothing(
    new_bus: BusFactory, topic: Callable[[str], str]
) -> None:
    publisher, listener = await new_bus(), await new_bus()
    t = topic("t")
    await listener.bus.subscribe([t])
    await publisher.bus.publish(t, b"x")
    await listener.wait_count(t, 1)
    assert publisher.got == []


async def test_only_subscribed_topics_arrive(
    new_bus: BusFactory, topic: Callable[[str], str]
) -> None:
    publisher, listener = await new_bus(), await new_bus()
    wanted = topic("wanted")
    other = beside(wanted, "other")
    await listener.bus.subscribe([wanted])
    await publisher.bus.publish(other, b"no")
    await publisher.bus.publish(wanted, b"yes")
    await listener.wait_count(wanted, 1)
    assert listener.got == [(wanted, b"yes")]


async def test_unsubscribe_stops_delivery(new_bus: BusFactory, topic: Callable[[str], str]) -> None:
    publisher, listener = await new_bus(), await new_bus()
    t = topic("t")
    marker = beside(t)
    await listener.bus.subscribe([t, marker])
    await publisher.bus.publish(t, b"1")
    await listener.wait_count(t, 1)
    await listener.bus.unsubscribe([t])
    await publisher.bus.publish(t, b"2")
    await publisher.bus.publish(marker, b"done")
    await listener.wait_count(marker, 1)
    assert listener.on(t) == [b"1"]
    await listener.bus.subscribe([t])
    await publisher.bus.publish(t, b"3")
    await listener.wait_count(t, 2)
    assert listener.on(t) == [b"1", b"3"]


async def test_subscribing_twice_still_delivers_once(
    new_bus: BusFactory, topic: Callable[[str], str]
) -> None:
    publisher, listener = await new_bus(), await new_bus()
    t = topic("t")
    marker = beside(t)
    await listener.bus.subscribe([t, marker])
    await listener.bus.subscribe([t])
    await publisher.bus.publish(t, b"once")
    await publisher.bus.publish(marker, b"done")
    await listener.wait_count(marker, 1)
    assert listener.on(t) == [b"once"]


async def test_nothing_published_before_subscribe_is_replayed(
    new_bus: BusFactory, topic: Callable[[str], str]
) -> None:
    publisher, listener = await new_bus(), await new_bus()
    t = topic("t")
    await publisher.bus.publish(t, b"early")
    await listener.bus.subscribe([t])
    await publisher.bus.publish(t, b"late")
    await listener.wait_count(t, 1)
    assert listener.on(t) == [b"late"]


async def test_messages_of_a_topic_keep_their_order(
    new_bus: BusFactory, topic: Callable[[str], str]
) -> None:
    a, b, listener = await new_bus(), await new_bus(), await new_bus()
    t1, t2 = topic("one"), topic("two")
    await listener.bus.subscribe([t1, t2])
    count = 300
    for i in range(count):
        await a.bus.publish(t1, i.to_bytes(2, "big"))
        await b.bus.publish(t2, i.to_bytes(2, "big"))
    await listener.wait_count(t1, count)
    await listener.wait_count(t2, count)
    expected = [i.to_bytes(2, "big") for i in range(count)]
    assert listener.on(t1) == expected
    assert listener.on(t2) == expected


async def test_concurrent_publishes_all_arrive(
    new_bus: BusFactory, topic: Callable[[str], str]
) -> None:
    publisher, listener = await new_bus(), await new_bus()
    t = topic("t")
    await listener.bus.subscribe([t])
    payloads = [f"m{i}".encode() for i in range(200)]
    await asyncio.gather(*(publisher.bus.publish(t, p) for p in payloads))
    await listener.wait_count(t, len(payloads))
    assert sorted(listener.on(t)) == sorted(payloads)


async def test_data_is_binary_safe(new_bus: BusFactory, topic: Callable[[str], str]) -> None:
    publisher, listener = await new_bus(), await new_bus()
    t = topic("t")
    await listener.bus.subscribe([t])
    payloads = [
        b"",
        bytes(range(256)),
        b"\r\n*3\r\n$7\r\nmessage\r\n",  # RESP framing inside the data
        b"\x00" * 17,
        "h\u00e9llo \u2603".encode(),
        b"\xff\xfe\xc3\x28",  # not UTF-8
        bytes(range(256)) * 800,  # 200 KiB
    ]
    for payload in payloads:
        await publisher.bus.publish(t, payload)
    await listener.wait_count(t, len(payloads))
    assert listener.on(t) == payloads


async def test_topic_names_are_taken_literally(
    new_bus: BusFactory, topic: Callable[[str], str]
) -> None:
    publisher, listener = await new_bus(), await new_bus()
    names = [
        topic("game:chess#g1"),
        topic("game:{braces}#x}{"),
        topic("game:m\u00fchle#\u2603 with spaces"),
        topic("*"),
        topic("game:chess#g1") + "x",
    ]
    # Each name is a slot of its own on a Redis Cluster: they may arrive in any order.
    # The one not subscribed has a barrier beside it.
    barrier = beside(names[-1])
    await listener.bus.subscribe([*names[:-1], barrier])
    for name in names:
        await publisher.bus.publish(name, name.encode())
    await publisher.bus.publish(barrier, b"")
    for name in [*names[:-1], barrier]:
        await listener.wait_count(name, 1)
    expected = [(name, name.encode()) for name in names[:-1]] + [(barrier, b"")]
    assert sorted(listener.got) == sorted(expected)


async def test_close_stops_delivery(new_bus: BusFactory, topic: Callable[[str], str]) -> None:
    publisher, closing, staying = await new_bus(), await new_bus(), await new_bus()
    t = topic("t")
    await closing.bus.subscribe([t])
    await staying.bus.subscribe([t])
    await closing.bus.close()
    await publisher.bus.publish(t, b"after close")
    await staying.wait_count(t, 1)
    assert closing.got == []
