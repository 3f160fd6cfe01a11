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
- ``read_many`` answers each ask as ``read`` would, in the order asked (the
  same stream may be asked twice, at different offsets);
- streams are independent;
- an append naming an event id already appended to that stream within
  ``event_id_ttl`` returns the position it took then, and keeps and publishes
  nothing; the id is per stream, and forgotten after its ttl.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio

from loadtest.harness.redis_cluster import RedisCluster
from protocol.envelope import decode_positioned
from server.bus import Bus, MemoryBus, MemoryHub
from server.bus.redis_bus import RedisBus
from server.bus.redis_cluster_bus import RedisClusterBus
from server.bus.redis_streams import RedisStreams
from server.bus.streams import Append, Fence, MemoryStreams, StreamLimits, Streams
from server.redis.client import command_client_for
from tests.contract.test_bus_contract import Receiver
from tests.services import redis_url_for_tests


@dataclass
class Pair:
    """A Streams and a started bus on the same backbone, listening to what it publishes."""

    streams: Streams
    inbox: Receiver


PairFactory = Callable[[StreamLimits], Awaitable[Pair]]

SHORT_TTL = 0.2
PAST_SHORT_TTL = 0.3
"""A sleep lasts at least this long, however loaded the machine: past it, what was
given ``SHORT_TTL`` is gone (Redis expires in milliseconds, memory by the clock)."""


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
    pair = await new_pair(StreamLimits(history_ttl=SHORT_TTL, meta_ttl=60))
    epoch = (await pair.streams.append(stream, b"e1", ())).epoch
    await pair.streams.append(stream, b"e2", ())
    await asyncio.sleep(PAST_SHORT_TTL)
    read = await pair.streams.read(stream, 0)
    assert (read.epoch, read.top, read.entries) == (epoch, 2, ())
    after = await pair.streams.append(stream, b"e3", ())
    assert (after.epoch, after.offset) == (epoch, 3)
    assert (await pair.streams.read(stream, 0)).entries == ((3, b"e3"),)


async def test_a_stream_whose_meta_expired_starts_a_new_epoch(
    new_pair: PairFactory, stream: str
) -> None:
    pair = await new_pair(StreamLimits(history_ttl=SHORT_TTL, meta_ttl=SHORT_TTL))
    old = await pair.streams.append(stream, b"e1", ())
    await asyncio.sleep(PAST_SHORT_TTL)
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
    positions = await pair.streams.append_many(
        [Append(a, b"1", ()), Append(b, b"1", ()), Append(a, b"2", ())]
    )
    assert [p.offset for p in positions] == [1, 1, 2]
    assert positions[0].epoch == positions[2].epoch
    assert (await pair.streams.read(a, 0)).entries == ((1, b"1"), (2, b"2"))
    assert (await pair.streams.read(b, 0)).entries == ((1, b"1"),)


async def test_the_same_event_id_twice_takes_one_offset_and_one_publish(
    new_pair: PairFactory, stream: str
) -> None:
    pair = await new_pair(StreamLimits())
    legacy = stream + "-legacy"  # another slot on a Redis Cluster, like ap:{games}
    topics = (stream, legacy)
    await pair.inbox.bus.subscribe(list(topics))
    first = await pair.streams.append(stream, b"e1", topics, "msg-1")
    again = await pair.streams.append(stream, b"e1 resent", topics, "msg-1")
    many = await pair.streams.append_many([Append(stream, b"e1 third", topics, "msg-1")])
    other = await pair.streams.append(stream, b"e2", topics, "msg-2")
    plain = await pair.streams.append(stream, b"e3", topics)
    assert again == first and many == [first]
    assert [first.offset, other.offset, plain.offset] == [1, 2, 3]
    assert (await pair.streams.read(stream, 0)).entries == ((1, b"e1"), (2, b"e2"), (3, b"e3"))
    for topic in topics:
        await pair.inbox.wait_count(topic, 3)
    await asyncio.sleep(0.2)  # room for a publish of the repeats to arrive
    for topic in topics:
        got = [decode_positioned(data) for data in pair.inbox.on(topic)]
        assert [(p.offset, p.data) for p in got] == [(1, b"e1"), (2, b"e2"), (3, b"e3")]


async def test_an_event_id_is_remembered_per_stream(new_pair: PairFactory) -> None:
    pair = await new_pair(StreamLimits())
    prefix = uuid.uuid4().hex[:8]
    a, b = f"user:{prefix}-a", f"user:{prefix}-b"
    await pair.streams.append(a, b"earlier", ())
    # One event to two users: each user stream takes it once.
    first = await pair.streams.append_many([Append(a, b"x", (), "m"), Append(b, b"x", (), "m")])
    again = await pair.streams.append_many([Append(a, b"x", (), "m"), Append(b, b"x", (), "m")])
    assert [p.offset for p in first] == [2, 1]
    assert again == first
    assert (await pair.streams.read(b, 0)).entries == ((1, b"x"),)


async def test_an_event_id_is_forgotten_after_its_ttl(new_pair: PairFactory, stream: str) -> None:
    pair = await new_pair(StreamLimits(event_id_ttl=SHORT_TTL))
    first = await pair.streams.append(stream, b"e1", (), "msg-1")
    await asyncio.sleep(PAST_SHORT_TTL)
    later = await pair.streams.append(stream, b"e1", (), "msg-1")
    assert (first.offset, later.offset) == (1, 2)


async def test_memory_streams_forget_event_ids_after_their_ttl() -> None:
    now = [0.0]
    streams = MemoryStreams(MemoryBus(), StreamLimits(event_id_ttl=900), clock=lambda: now[0])
    first = await streams.append("game:m#g", b"e1", (), "msg-1")
    now[0] = 899.0
    assert await streams.append("game:m#g", b"e1", (), "msg-1") == first
    await streams.append("game:m#g", b"e2", (), "msg-2")
    now[0] = 901.0
    assert (await streams.append("game:m#g", b"e1", (), "msg-1")).offset == 3
    # msg-1 is remembered again, msg-2 (from 899 s) still is.
    assert (await streams.append("game:m#g", b"e2", (), "msg-2")).offset == 2
    now[0] = 1800.0
    assert (await streams.append("game:m#g", b"e2", (), "msg-2")).offset == 4


async def test_read_many_answers_each_ask_as_read_does(new_pair: PairFactory) -> None:
    pair = await new_pair(StreamLimits(history_size=3))
    prefix = uuid.uuid4().hex[:8]
    a, b, unknown = f"game:m#{prefix}-a", f"user:{prefix}-b", f"game:m#{prefix}-new"
    for i in range(1, 6):
        await pair.streams.append(a, f"a{i}".encode(), ())
    await pair.streams.append(b, b"b1", ())
    asks = [(b, 0), (a, 3), (unknown, 0), (a, 0), (b, 1)]
    reads = await pair.streams.read_many(asks)
    assert [(r.top, r.entries) for r in reads] == [
        (1, ((1, b"b1"),)),
        (5, ((4, b"a4"), (5, b"a5"))),
        (0, ()),
        (5, ((3, b"a3"), (4, b"a4"), (5, b"a5"))),
        (1, ()),
    ]
    assert reads[1].epoch == reads[3].epoch != reads[0].epoch == reads[4].epoch
    # The unknown stream got its epoch, as with read, and keeps it.
    assert (await pair.streams.read(unknown, 0)).epoch == reads[2].epoch
    assert await pair.streams.read_many([]) == []
    singles = [await pair.streams.read(stream, after) for stream, after in asks]
    assert await pair.streams.read_many(asks) == singles


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


async def test_memory_streams_count_the_bytes_their_histories_hold() -> None:
    now = [0.0]
    streams = MemoryStreams(
        MemoryBus(),
        StreamLimits(history_size=2, history_ttl=10, meta_ttl=100),
        clock=lambda: now[0],
    )
    for data in (b"a" * 100, b"b" * 10, b"c" * 1):
        await streams.append("game:m#1", data, ())
    await streams.append("game:m#2", b"d" * 1000, ())
    assert streams.history_bytes() == 10 + 1 + 1000  # the first event left the capped history
    now[0] = 20.0
    await streams.read("game:m#1", 0)  # past its history ttl: the history is dropped
    assert streams.history_bytes() == 1000


async def test_a_fenced_append_checks_and_releases_its_lease(
    new_pair: PairFactory, stream: str, request: pytest.FixtureRequest
) -> None:
    """The lease is the game's chat lock (same slot); memory streams leave the fence
    to the local lock's holder, so only the Redis forms look at it."""
    kind = request.node.callspec.params["new_pair"]
    pair = await new_pair(StreamLimits())
    if kind == "memory":
        # One process: the lock is a local one, released by its holder; the fence is
        # not looked at, and the appends go on as without one.
        fence = Fence("ap:{" + stream + "}:chat-lock", "mine", release=True)
        (position,) = await pair.streams.append_many([Append(stream, b"e1", (), None, fence)])
        assert position.offset == 1 and not fence.applied and not fence.lost
        return
    client: Any
    if kind == "redis":
        client = redis.asyncio.Redis.from_url(request.getfixturevalue("redis_url"))
    else:
        cluster: RedisCluster = request.getfixturevalue("shared_redis_cluster")
        client = command_client_for(cluster.url, cluster=True)
    lease = "ap:{" + stream + "}:chat-lock"
    try:
        await client.set(lease, "mine", px=60_000)
        kept = Fence(lease, "mine")  # checked, not released
        ours = Fence(lease, "mine", release=True)
        items = [Append(stream, b"e1", (), None, kept), Append(stream, b"e2", (), None, ours)]
        positions = await pair.streams.append_many(items)
        assert [p.offset for p in positions] == [1, 2]
        assert (kept.applied, kept.lost, ours.applied, ours.lost) == (True, False, True, False)
        assert await client.exists(lease) == 0
        # Someone else's lease: the event is appended all the same, the lease is kept.
        await client.set(lease, "theirs", px=60_000)
        late = Fence(lease, "mine", release=True)
        (position,) = await pair.streams.append_many([Append(stream, b"e3", (), None, late)])
        assert position.offset == 3 and late.lost
        assert await client.get(lease) == b"theirs"
        # A repeat of a named event still releases (its first reply was lost).
        await client.set(lease, "mine", px=60_000)
        first = Fence(lease, "mine")
        await pair.streams.append_many([Append(stream, b"e4", (), "named", first)])
        again = Fence(lease, "mine", release=True)
        (repeat,) = await pair.streams.append_many([Append(stream, b"e4", (), "named", again)])
        assert repeat.offset == 4 and not again.lost and await client.exists(lease) == 0
    finally:
        await client.aclose()
