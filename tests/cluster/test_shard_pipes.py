"""The per-primary command connections of a Redis Cluster bus, on the session's cluster:
legacy publishes in offset order, ``ASK``/``MOVED`` followed during a slot move, and a
primary that stops answering given up on and retried."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from loadtest.harness.redis_cluster import RedisCluster, redis_cli
from protocol.envelope import decode_positioned
from server.bus.redis_cluster_bus import RedisClusterBus
from server.bus.redis_streams import RedisStreams
from server.bus.topics import ALL_GAMES
from server.redis.client import make_cluster_client
from server.redis.keys import channel_for
from server.redis.shard_pipes import ShardPipes
from server.runtime.metrics import Registry
from tests.waiting import eventually


@pytest.fixture
async def bus(shared_redis_cluster: RedisCluster) -> AsyncIterator[RedisClusterBus]:
    shared_redis_cluster.wait_ok()
    made = RedisClusterBus(shared_redis_cluster.url)
    await made.start(lambda topic, data: None)
    yield made
    await made.close()


async def test_a_games_legacy_publishes_follow_its_offsets(
    shared_redis_cluster: RedisCluster, bus: RedisClusterBus
) -> None:
    """Many appends of one game at once: the script replies come in offset order,
    and ``ap:{games}`` (another slot, not awaited) gets them in that order."""
    game = f"game:chess#{uuid.uuid4().hex[:8]}"
    assert key_slot(channel_for(game).encode()) != key_slot(channel_for(ALL_GAMES).encode())
    offsets: list[int] = []
    listener = RedisClusterBus(shared_redis_cluster.url)
    await listener.start(lambda topic, data: offsets.append(decode_positioned(data).offset))
    streams = RedisStreams.on_cluster(bus)
    try:
        await listener.subscribe([ALL_GAMES])
        await streams.start()
        positions = await asyncio.gather(
            *(streams.append(game, b"e%d" % i, (game, ALL_GAMES)) for i in range(300))
        )
        assert sorted(p.offset for p in positions) == list(range(1, 301))
        await eventually(lambda: len(offsets) >= 300, 5, "300 legacy publishes")
        assert offsets == list(range(1, 301))
    finally:
        await listener.close()
        await streams.close()


async def test_ask_and_moved_are_followed_while_a_slot_moves(
    shared_redis_cluster: RedisCluster, bus: RedisClusterBus
) -> None:
    redis = shared_redis_cluster
    tag = "{pipes-" + uuid.uuid4().hex[:8] + "}"
    slot = key_slot(tag.encode())
    source = redis.owner(slot)
    target = next(p for p in redis.primaries() if p != source)
    pipes = bus.pipes
    deadline = time.monotonic() + 10

    async def run(*args: object) -> object:
        return await pipes.execute(slot, args, deadline)

    assert await run("SET", f"{tag}:a", "1") == b"OK"
    await asyncio.to_thread(redis.begin_migration, slot, source, target)
    # The session's cluster is not flushed: other tests' keys may share the slot,
    # and they move too. What matters is that none is left on the source.
    assert await asyncio.to_thread(redis.move_keys, slot, source, target) >= 1
    assert redis_cli(source, "cluster", "countkeysinslot", str(slot)).strip() == "0"
    # The key is gone from the source: it answers ASK, and the command runs on the target.
    assert await run("GET", f"{tag}:a") == b"1"
    assert await run("SET", f"{tag}:b", "2") == b"OK"
    await asyncio.to_thread(redis.finish_migration, slot, target)
    # The map still names the source: MOVED, and the map is updated.
    assert await run("MGET", f"{tag}:a", f"{tag}:b") == [b"1", b"2"]
    assert int(bus._client.nodes_manager.get_node_from_slot(slot).port) == target
    assert await run("DEL", f"{tag}:a", f"{tag}:b") == 2


def replica_of(redis: RedisCluster, primary: int) -> int:
    """Port of the replica of the primary on port ``primary``."""
    primary_id = redis.node_id(primary)
    for line in redis_cli(primary, "cluster", "nodes").splitlines():
        parts = line.split()
        if len(parts) > 3 and "slave" in parts[2] and parts[3] == primary_id:
            return int(parts[1].split("@")[0].rsplit(":", 1)[1])
    raise AssertionError(f"no replica of {primary}")


@contextlib.asynccontextmanager
async def primary_to_freeze(
    redis: RedisCluster, slot: int
) -> AsyncIterator[tuple[int, subprocess.Popen[bytes]]]:
    """The port and process of ``slot``'s primary, for the test to SIGSTOP, its replica
    told not to take over meanwhile: no timing decides a verdict. On the way out the
    primary runs again, its replica may fail over again, and the cluster is whole."""
    redis.wait_ok()
    primary = redis.owner(slot)
    replica = replica_of(redis, primary)
    process = redis.instance(primary).process
    assert process is not None
    assert redis_cli(replica, "config", "set", "cluster-replica-no-failover", "yes").strip() == "OK"
    try:
        yield primary, process
    finally:
        process.send_signal(signal.SIGCONT)
        redis_cli(replica, "config", "set", "cluster-replica-no-failover", "no")
    await asyncio.to_thread(redis.wait_ok)


@contextlib.asynccontextmanager
async def quick_to_stall(redis: RedisCluster) -> AsyncIterator[tuple[ShardPipes, Registry]]:
    """Started pipes that give up on a silent primary after 0.2 s, and their counters."""
    client = make_cluster_client(redis.url)
    metrics = Registry()
    pipes = ShardPipes(client, stall_timeout=0.2, metrics=metrics)
    await pipes.start()
    try:
        yield pipes, metrics
    finally:
        await pipes.close()
        await client.aclose()


async def test_a_primary_that_stops_answering_is_given_up_on_and_retried(
    shared_redis_cluster: RedisCluster,
) -> None:
    """SIGSTOP: the socket stays open and silent, with no reset to notice. The
    command waiting on it fails after the stall timeout and is sent again (the
    frozen primary even takes new connections, and never answers their
    handshake); once the primary answers, it succeeds.

    The primary stays frozen until two retries were counted, however long that
    takes a starved test process, and its replica is told not to take over
    meanwhile: no timing decides the verdict."""
    tag = "{pipes-" + uuid.uuid4().hex[:8] + "}"
    slot = key_slot(tag.encode())
    async with (
        primary_to_freeze(shared_redis_cluster, slot) as (_, process),
        quick_to_stall(shared_redis_cluster) as (pipes, metrics),
    ):
        retried = metrics.value("ap_bus_failover_retries_total")
        assert await pipes.execute(slot, ("SET", f"{tag}:a", "1"), time.monotonic() + 5) == b"OK"
        process.send_signal(signal.SIGSTOP)
        reading = asyncio.create_task(
            pipes.execute(slot, ("GET", f"{tag}:a"), time.monotonic() + 60)
        )
        await eventually(
            lambda: metrics.value("ap_bus_failover_retries_total") >= retried + 2,
            30,
            "two retries while the primary is frozen",
        )
        assert not reading.done(), "answered while the primary was frozen"
        process.send_signal(signal.SIGCONT)
        assert await reading == b"1"


async def test_legacy_publishes_keep_their_order_through_a_frozen_primary(
    shared_redis_cluster: RedisCluster,
) -> None:
    """``publish_in_order`` (``ap:{games}``) while the channel's primary is frozen:
    the batch on the stalled connection fails, each message is sent again in turn,
    one whose deadline passes is given up and counted, and the later ones go out,
    in order, once the primary answers. (The stalled connection's bytes may run
    too when it wakes: a message may come twice, never ahead of an earlier one.)"""
    channel = "ap:{ordered-" + uuid.uuid4().hex[:8] + "}"
    slot = key_slot(channel.encode())
    got: list[bytes] = []
    async with (
        primary_to_freeze(shared_redis_cluster, slot) as (primary, process),
        quick_to_stall(shared_redis_cluster) as (pipes, metrics),
    ):
        listener = aioredis.Redis(host="127.0.0.1", port=primary)
        heard = listener.pubsub()
        await heard.ssubscribe(channel)

        async def listen() -> None:
            async for message in heard.listen():
                if message["type"] == "smessage":
                    got.append(message["data"])

        listening = asyncio.create_task(listen())
        try:
            pipes.publish_in_order(slot, channel, b"m0", 60)
            await eventually(lambda: got == [b"m0"], 10, "m0")
            process.send_signal(signal.SIGSTOP)
            pipes.publish_in_order(slot, channel, b"m1", 0.1)  # given up while frozen
            pipes.publish_in_order(slot, channel, b"m2", 60)
            pipes.publish_in_order(slot, channel, b"m3", 60)
            await eventually(
                lambda: (
                    metrics.value("ap_bus_ordered_publish_drops_total") == 1
                    and metrics.value("ap_bus_failover_retries_total") >= 2
                ),
                30,
                "m1 given up and m2 retried while the primary is frozen",
            )
            assert got == [b"m0"]
            process.send_signal(signal.SIGCONT)
            await eventually(lambda: {b"m2", b"m3"} <= set(got), 30, "m2 and m3")
            assert got[0] == b"m0"
            assert got.index(b"m2") < got.index(b"m3")
            assert metrics.value("ap_bus_ordered_publish_drops_total") == 1
        finally:
            listening.cancel()
            await heard.aclose()
            await listener.aclose()
