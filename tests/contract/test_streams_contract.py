"""The Streams contract: one suite over MemoryStreams and RedisStreams (one Redis
and a Redis Cluster).

What every implementation promises (``server/bus/streams.py``):

- ``append`` gives each event of a stream the next offset of its epoch (1, 2,
  3, ... with no gap and no repeat, however many appenders at once), keeps it
  in the history and publishes ``encode_positioned(epoch, offset, data)`` on
  each topic given, in offset order;
- ``read(stream, after)`` returns the epoch, the top and the kept entries above
  ``after``, in order; at most ``history_size`` of them, none older than
  ``history_ttl`` after the last event;
- a stream never written gets an epoch on ``read``, at top 0, and the next
  ``append`` continues that epoch;
- streams are independent.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import pytest

from loadtest.redis_cluster import RedisCluster
from protocol.envelope import decode_positioned
from server.bus import Bus, MemoryBus, MemoryHub
from server.bus.redis_bus import RedisBus
from server.bus.redis_cluster_bus import RedisClusterBus
from server.bus.redis_streams import RedisStreams
from server.bus.streams import MemoryStreams, StreamLimits, Streams
from tests.contract.test_bus_contract import Receiver
from tests.services import redis_url_for_tests


@dataclass
class Pair:
    """A Streams and a started bus on the same backbone, listening to what it publishes."""

    streams: Streams
    inbox: Receiver


PairFactory = Callable[[StreamLimits], Awaitable[Pair]]


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_url_for_tests() as url:
        yield url


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def new_pair(request: pytest.FixtureRequest) -> AsyncIterator[PairFactory]:
    closers: list[Callable[[], Awaitable[None]]] = []
    hub = MemoryHub()

    async def make(limits: StreamLimits) -> Pair:
        streams: Streams
        listener: Bus
        if request.param == "memory":
            bus = MemoryBus(hub)
            listener = MemoryBus(hub)
            streams = MemoryStreams(bus, limits)
            await bus.start(lambda topic, data: None)
            closers.append(bus.close)
        elif request.param == "redis-cluster":
            cluster: RedisCluster = request.getfixturevalue("shared_redis_cluster")
            cluster_bus = RedisClusterBus(cluster.url)
            listener = cluster_bus
            streams = RedisStreams.on_cluster(cluster_bus, limits)
        else:
            url = request.getfixturevalue("redis_url")
            listener = RedisBus(url)
            streams = RedisStreams(url, limits)
        inbox = Receiver(listener)
        await listener.start(inbox)
        await streams.start()
        closers.extend([listener.close, streams.close])
        return Pair(streams, inbox)

    yield make
    for close in closers:
        await close()


@pytest.fixture
def stream() -> str:
    return f"game:contract#{uuid.uuid4().hex[:10]}"


async def test_offsets_count_from_one_within_one_epoch(new_pair: PairFactory, stream: str) -> None:
    pair = await new_pair(StreamLimits())
    positions = [await pair.streams.append(stream, f"e{i}".encode(), ()) for i in range(1, 6)]
    assert [p.offset for p in positions] == [1, 2, 3, 4, 5]
    assert len({p.epoch for p in positions}) == 1 and positions[0].epoch


async def test_append_publishes_positioned_messages_in_order(
    new_pair: PairFactory, stream: str
) -> None:
    pair = await new_pair(StreamLimits())
    other = stream + "-legacy"
    await pair.inbox.bus.subscribe([stream, other])
    for i in range(1, 4):
        await pair.streams.append(stream, f"e{i}".encode(), (stream, other))
    await pair.inbox.wait_count(stream, 3)
    await pair.inbox.wait_count(other, 3)
    got = [decode_positioned(data) for data in pair.inbox.on(stream)]
    assert [(p.offset, p.data) for p in got] == [(1, b"e1"), (2, b"e2"), (3, b"e3")]
    assert pair.inbox.on(other) == pair.inbox.on(stream)


async def test_read_returns_the_entries_above_after(new_pair: PairFactory, stream: str) -> None:
    pair = await new_pair(StreamLimits())
    for i in range(1, 6):
        epoch = (await pair.streams.append(stream, f"e{i}".encode(), ())).epoch
    read = await pair.streams.read(stream, 2)
    assert (read.epoch, read.top) == (epoch, 5)
    assert read.entries == ((3, b"e3"), (4, b"e4"), (5, b"e5"))
    assert (await pair.streams.read(stream, 5)).entries == ()


async def test_history_keeps_only_the_last_size_events(new_pair: PairFactory, stream: str) -> None:
    pair = await new_pair(StreamLimits(history_size=3))
    for i in range(1, 8):
        await pair.streams.append(stream, f"e{i}".encode(), ())
    read = await pair.streams.read(stream, 0)
    assert read.top == 7
    assert [o for o, _ in read.entries] == [5, 6, 7]


async def test_history_expires_but_the_epoch_and_top_stay(
    new_pair: PairFactory, stream: str
) -> None:
    pair = await new_pair(StreamLimits(history_ttl=1, meta_ttl=60))
    epoch = (await pair.streams.append(stream, b"e1", ())).epoch
    await pair.streams.append(stream, b"e2", ())
    await asyncio.sleep(2.1)  # Redis expires keys to the second
    read = await pair.streams.read(stream, 0)
    assert (read.epoch, read.top, read.entries) == (epoch, 2, ())
    after = await pair.streams.append(stream, b"e3", ())
    assert (after.epoch, after.offset) == (epoch, 3)
    assert (await pair.streams.read(stream, 0)).entries == ((3, b"e3"),)


async def test_a_stream_whose_meta_expired_starts_a_new_epoch(
    new_pair: PairFactory, stream: str
) -> None:
    pair = await new_pair(StreamLimits(history_ttl=1, meta_ttl=1))
    old = await pair.streams.append(stream, b"e1", ())
    await asyncio.sleep(2.1)
    new = await pair.streams.append(stream, b"e2", ())
    assert new.epoch != old.epoch and new.offset == 1
    assert (await pair.streams.read(stream, 0)).entries == ((1, b"e2"),)


async def test_read_of_an_unknown_stream_creates_its_epoch(
    new_pair: PairFactory, stream: str
) -> None:
    pair = await new_pair(StreamLimits())
    read = await pair.streams.read(stream, 0)
    assert read.top == 0 and read.entries == () and read.epoch
    assert (await pair.streams.read(stream, 0)).epoch == read.epoch
    first = await pair.streams.append(stream, b"e1", ())
    assert (first.epoch, first.offset) == (read.epoch, 1)


async def test_concurrent_appenders_never_share_an_offset(
    new_pair: PairFactory, stream: str
) -> None:
    pair = await new_pair(StreamLimits(history_size=500))
    appenders = [pair.streams, (await new_pair(StreamLimits(history_size=500))).streams]

    async def run(index: int) -> list[int]:
        out = []
        for i in range(100):
            position = await appenders[index % 2].append(stream, f"{index}-{i}".encode(), ())
            out.append(position.offset)
        return out

    results = await asyncio.gather(*(run(i) for i in range(4)))
    offsets = sorted(o for result in results for o in result)
    assert offsets == list(range(1, 401))
    for result in results:
        assert result == sorted(result)


async def test_append_many_keeps_order_and_streams_apart(new_pair: PairFactory) -> None:
    pair = await new_pair(StreamLimits())
    prefix = uuid.uuid4().hex[:8]
    a, b = f"user:{prefix}-a", f"user:{prefix}-b"
    positions = await pair.streams.append_many([(a, b"1", ()), (b, b"1", ()), (a, b"2", ())])
    assert [p.offset for p in positions] == [1, 1, 2]
    assert positions[0].epoch == positions[2].epoch
    assert (await pair.streams.read(a, 0)).entries == ((1, b"1"), (2, b"2"))
    assert (await pair.streams.read(b, 0)).entries == ((1, b"1"),)


async def test_memory_streams_forget_idle_streams() -> None:
    now = [0.0]
    bus = MemoryBus()
    streams = MemoryStreams(bus, StreamLimits(history_ttl=10, meta_ttl=100), clock=lambda: now[0])
    await streams.append("game:m#old", b"x", ())
    now[0] = 50.0
    await streams.append("game:m#recent", b"x", ())
    now[0] = 120.0
    for _ in range(4096):
        await streams.append("game:m#busy", b"x", ())
    # The old stream passed its meta ttl, the recent one only its history ttl.
    assert streams.stream_count() == 2
    assert (await streams.read("game:m#recent", 0)).entries == ()
