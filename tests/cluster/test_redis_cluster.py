"""Three nodes over a real six-instance Redis Cluster: sharding, failover, restart;
and the bridges' dedup and lease through a failover.

The module starts a cluster of its own (these tests kill and restart its
instances) and flushes it before each test. ``tests/cluster/test_presence.py``
and the bus contract suite run over the session's shared cluster as well.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import pytest
from redis.crc import key_slot

from loadtest.harness.redis_cluster import RedisCluster, redis_cli, redis_cluster_for_tests
from server.bus.redis_cluster_bus import RedisClusterBus
from server.bus.topics import PRESENCE
from server.coordination.dedup import Claim, RedisClusterDedup
from server.coordination.lease import LeaseState, RedisLease
from server.ingress.notifications import LEASE_KEY
from server.redis.client import make_cluster_client
from server.redis.keys import channel_for
from tests.client import Client
from tests.cluster.conftest import nodes_on
from tests.cluster.harness import SLACK, Cluster, wait_visible
from tests.waiting import eventually

FAILOVER_BOUND = 5.0
"""Kill -9 of a primary to delivery resumed, with a 1 s cluster node timeout."""


@pytest.fixture(scope="module")
def own_redis_cluster() -> Iterator[RedisCluster]:
    with redis_cluster_for_tests() as cluster:
        yield cluster


@pytest.fixture
async def nodes(
    own_redis_cluster: RedisCluster, request: pytest.FixtureRequest, dynamodb_endpoint: str
) -> AsyncIterator[Cluster]:
    own_redis_cluster.wait_ok()
    own_redis_cluster.flush()
    async with nodes_on(own_redis_cluster, request, dynamodb_endpoint) as running:
        yield running


def game(meta: str, game_id: str) -> dict[str, Any]:
    return {"verb": "game", "payload": {"meta": meta, "id": game_id}}


def got(client: Client, game_id: str) -> list[str]:
    return [m["payload"]["seen"] for m in client.of_verb("game") if m["payload"]["id"] == game_id]


def got_all(client: Client, game_ids: list[str]) -> bool:
    return all(got(client, g) for g in game_ids)


def got_more_than(client: Client, game_id: str, count: int) -> bool:
    return len(got(client, game_id)) > count


def one_game_per_shard(redis: RedisCluster) -> dict[int, str]:
    """A game id per primary, chosen so that its channel lives on that primary."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < 3:
        game_id = f"g{i}"
        owner = redis.owner(key_slot(channel_for(f"game:chess#{game_id}").encode()))
        found.setdefault(owner, game_id)
        i += 1
    return found


def shard_subscribers(port: int, channel: str) -> int:
    out = redis_cli(port, "pubsub", "shardnumsub", channel).split()
    return int(out[1]) if len(out) > 1 else -1


def subscribed_nodes_are(count: int, port: int, channel: str) -> bool:
    return shard_subscribers(port, channel) == count


async def test_events_cross_nodes_on_every_shard_and_stay_on_their_own(nodes: Cluster) -> None:
    redis = nodes.redis
    assert isinstance(redis, RedisCluster)
    by_shard = one_game_per_shard(redis)
    games = [("chess", g) for g in by_shard.values()]
    watchers = [await nodes.client(n, f"w-{n}", games=games) for n in ("n1", "n2", "n3")]
    for port, game_id in by_shard.items():
        channel = channel_for(f"game:chess#{game_id}")
        # SSUBSCRIBE went to the channel's own shard: three nodes there, none elsewhere.
        await eventually(partial(subscribed_nodes_are, 3, port, channel), 5, "3 nodes")
        for other in by_shard:
            if other != port:
                assert shard_subscribers(other, channel) == 0
    for i, (source, game_id) in enumerate(zip(("n1", "n2", "n3"), by_shard.values(), strict=True)):
        body = game("chess", game_id)
        body["payload"]["seen"] = f"e{i}"
        assert await nodes.publish(source, body) == 202
    for client in watchers:
        await client.wait_for(partial(got_all, client, [g for _, g in games]), 5 + SLACK)
        for i, (_, game_id) in enumerate(games):
            assert got(client, game_id) == [f"e{i}"]
    # Presence lives in one slot: its delta channel is on exactly one primary.
    deltas = channel_for(PRESENCE)
    counts = {port: shard_subscribers(port, deltas) for port in redis.primaries()}
    assert sorted(counts.values()) == [0, 0, 3]
    assert counts[redis.owner(key_slot(deltas.encode()))] == 3


async def churn(nodes: Cluster, rounds: int, prefix: str) -> set[str]:
    """Users come and go on every node; returns the ones left connected."""
    kept: set[str] = set()
    for i in range(rounds):
        name, user = ("n1", "n2", "n3")[i % 3], f"{prefix}{i}"
        client = await nodes.client(name, user)
        if i % 2:
            await client.close()
        else:
            kept.add(user)
        await asyncio.sleep(0.05)
    return kept


async def eventually_ready(nodes: Cluster, name: str, within: float) -> None:
    deadline = time.monotonic() + within
    while await nodes.readyz(name) != 200:
        assert time.monotonic() < deadline, f"{name} not ready in {within:g}s"
        await asyncio.sleep(0.1)


def assert_no_gap(client: Client) -> None:
    assert client.presence.gaps == 0, "a delta was missed without a fresh snapshot"


async def test_kill_9_of_the_presence_primary_fails_over_without_a_client_gap(
    nodes: Cluster,
) -> None:
    redis = nodes.redis
    assert isinstance(redis, RedisCluster)
    presence_slot = key_slot(channel_for(PRESENCE).encode())
    victim = redis.owner(presence_slot)
    by_shard = one_game_per_shard(redis)
    hit_game = by_shard[victim]
    calm_game = next(g for p, g in by_shard.items() if p != victim)
    games = [("chess", hit_game), ("chess", calm_game)]
    # Stream speakers: each game event carries its offset, so a gap would show.
    observers = [
        await nodes.client(n, f"obs-{n}", games=games, since={}) for n in ("n1", "n2", "n3")
    ]
    kept = await churn(nodes, 6, "before")
    expected = {f"obs-{n}" for n in ("n1", "n2", "n3")} | kept
    for observer in observers:
        await wait_visible(observer, expected, 5 + SLACK, "joins before the kill")

    sent: list[str] = []
    stop = asyncio.Event()

    async def publish_steadily(game_id: str) -> None:
        i = 0
        while not stop.is_set():
            body = game("chess", game_id)
            body["payload"]["seen"] = f"{game_id}-{i}"
            if await nodes.publish(("n1", "n2", "n3")[i % 3], body) == 202:
                sent.append(f"{game_id}-{i}")
            i += 1
            await asyncio.sleep(0.05)

    # A shard failing over is lost by every node at once, and each node still
    # serves its clients: /readyz stays 200 while the bus repairs that shard.
    readiness: list[tuple[str, int | None, float]] = []
    resumed = asyncio.Event()

    async def sample_readiness() -> None:
        while not resumed.is_set():
            for name in ("n1", "n2", "n3"):
                connected = await nodes.metric(name, "ap_bus_connected")
                readiness.append((name, await nodes.readyz(name), connected))
            await asyncio.sleep(0.05)

    publishers = [asyncio.create_task(publish_steadily(g)) for _, g in games]
    await asyncio.sleep(0.5)
    killed_at = time.monotonic()
    redis.instance(victim).kill()
    sampler = asyncio.create_task(sample_readiness())
    new_owner = await asyncio.to_thread(redis.wait_failover, victim, presence_slot)
    assert new_owner != victim
    # Delivery of the hit game resumes on every node within the bound.
    seen_before = {id(o): len(got(o, hit_game)) for o in observers}
    for observer in observers:
        await observer.wait_for(
            partial(got_more_than, observer, hit_game, seen_before[id(observer)] + 2),
            FAILOVER_BOUND + SLACK,
        )
    resumed_after = time.monotonic() - killed_at
    resumed.set()
    await sampler
    assert any(connected == 0 for _, _, connected in readiness), "no sample during the repair"
    assert [(n, status) for n, status, _ in readiness if status != 200] == []
    for name in ("n1", "n2", "n3"):
        assert nodes.nodes[name].alive
        await eventually_ready(nodes, name, 5 + SLACK)
    kept |= await churn(nodes, 6, "after")
    stop.set()
    await asyncio.gather(*publishers)
    expected = {f"obs-{n}" for n in ("n1", "n2", "n3")} | kept
    for observer in observers:
        await wait_visible(observer, expected, 5 + SLACK, "joins after the failover")
        assert_no_gap(observer)
    # The shard that kept its primary never stalled: every event of its game arrived.
    calm_sent = [s for s in sent if s.startswith(calm_game + "-")]
    for observer in observers:
        await observer.wait_for(
            partial(got_more_than, observer, calm_game, len(calm_sent) - 1), 5 + SLACK
        )
        assert got(observer, calm_game) == calm_sent
    # No event was lost in the switch, and none arrived out of order: every
    # accepted event of the failed-over game, at consecutive offsets.
    hit_sent = [s for s in sent if s.startswith(hit_game + "-")]
    stream = f"game:chess#{hit_game}"
    for observer in observers:
        await observer.wait_for(
            partial(got_more_than, observer, hit_game, len(hit_sent) - 1), 5 + SLACK
        )
        assert got(observer, hit_game) == hit_sent
        offsets = observer.offsets(stream)
        assert offsets == list(range(offsets[0], offsets[0] + len(offsets)))
    print(f"delivery of the failed-over game resumed {resumed_after:.2f}s after the kill")


async def test_a_whole_cluster_restart(nodes: Cluster) -> None:
    redis = nodes.redis
    assert isinstance(redis, RedisCluster)
    by_shard = one_game_per_shard(redis)
    games = [("chess", g) for g in by_shard.values()]
    observers = [await nodes.client(n, f"obs-{n}", games=games) for n in ("n1", "n2", "n3")]
    expected = {f"obs-{n}" for n in ("n1", "n2", "n3")}
    for observer in observers:
        await wait_visible(observer, expected, 5 + SLACK, "joins")
    await asyncio.to_thread(redis.restart_all)
    for name in ("n1", "n2", "n3"):
        await eventually_ready(nodes, name, 15 + SLACK)
    # Redis lost everything: nodes re-register, and clients get fresh snapshots.
    late = await nodes.client("n2", "late")
    expected.add("late")
    for observer in [*observers, late]:
        await wait_visible(observer, expected, 10 + SLACK, "presence rebuilt")
        assert_no_gap(observer)
    # Every node's subscriptions are back on the shards that own them.
    for _, game_id in games:
        channel = channel_for(f"game:chess#{game_id}")
        owner = redis.owner(key_slot(channel.encode()))
        await eventually(
            partial(subscribed_nodes_are, 3, owner, channel),
            5 + SLACK,
            f"3 nodes on {channel} at {owner}: "
            + str({i.port: shard_subscribers(i.port, channel) for i in redis.instances}),
        )
    for i, (_, game_id) in enumerate(games):
        body = game("chess", game_id)
        body["payload"]["seen"] = f"after-{i}"
        assert await nodes.publish(("n1", "n2", "n3")[i], body) == 202
    for observer in observers:
        try:
            await observer.wait_for(partial(got_all, observer, [g for _, g in games]), 5 + SLACK)
        except TimeoutError:
            seen = {g: got(observer, g) for _, g in games}
            raise AssertionError(f"observer {observers.index(observer)} got {seen}") from None
        for i, (_, game_id) in enumerate(games):
            assert got(observer, game_id) == [f"after-{i}"]


async def test_user_streams_are_sharded_channels_on_their_own_shard(nodes: Cluster) -> None:
    redis = nodes.redis
    assert isinstance(redis, RedisCluster)
    tabs = [await nodes.client("n1", "bot1", since={}), await nodes.client("n2", "bot1")]
    bystander = await nodes.client("n3", "other")
    channel = channel_for("user:bot1")
    owner = redis.owner(key_slot(channel.encode()))
    # Only the two nodes holding bot1 listen, and only on the shard of its slot.
    await eventually(partial(subscribed_nodes_are, 2, owner, channel), 5, "2 nodes on bot1")
    for port in redis.primaries():
        if port != owner:
            assert shard_subscribers(port, channel) == 0
    status, reply = await nodes.publish_reply(
        "n3", {"verb": "yourTurn", "payload": {"meta": "chess", "id": "g1"}, "users": ["bot1"]}
    )
    assert status == 202
    position = reply["positions"]["user:bot1"]
    for tab in tabs:
        event = await tab.next_message(lambda m: m["verb"] == "yourTurn", 5 + SLACK)
        assert (event["stream"], event["offset"]) == ("user:bot1", position["offset"])
    await bystander.barrier()
    assert bystander.of_verb("yourTurn") == []


async def test_a_frozen_shard_does_not_stall_the_others(own_redis_cluster: RedisCluster) -> None:
    """SIGSTOP a primary: its sockets stay open and silent, the worst case for a
    reader that polls shards in turn. Messages on the other shards still arrive
    at once, because each shard has a reader of its own."""
    redis = own_redis_cluster
    redis.wait_ok()
    topics: dict[int, str] = {}
    i = 0
    while len(topics) < 3:
        topic = f"frozen-{i}"
        topics.setdefault(redis.owner(key_slot(channel_for(topic).encode())), topic)
        i += 1
    arrived: dict[bytes, float] = {}
    sub, pub = RedisClusterBus(redis.url), RedisClusterBus(redis.url)

    def record(topic: str, data: bytes) -> None:
        arrived.setdefault(data, time.monotonic())

    await sub.start(record)
    await pub.start(lambda topic, data: None)
    frozen = next(iter(topics))
    process = redis.instance(frozen).process
    assert process is not None
    try:
        await sub.subscribe(topics.values())
        process.send_signal(signal.SIGSTOP)
        delays: list[float] = []
        for n in range(10):
            for port, topic in topics.items():
                if port == frozen:
                    continue
                token = f"{topic}/{n}".encode()
                sent = time.monotonic()
                await pub.publish(topic, token)
                await eventually(lambda t=token: t in arrived, 2.0, f"{token!r}")  # type: ignore[misc]
                delays.append(arrived[token] - sent)
        assert max(delays) < 0.5, f"a healthy shard waited on the frozen one: {max(delays):.3f}s"
    finally:
        process.send_signal(signal.SIGCONT)
        await sub.close()
        await pub.close()
        redis.wait_ok()


async def test_the_bridges_dedup_and_lease_ride_through_a_primary_failover(
    own_redis_cluster: RedisCluster,
) -> None:
    """Kill -9 the primary of the stream lease's slot: the holder's renewal and the
    dedup calls on that slot wait for the promoted replica instead of failing."""
    redis = own_redis_cluster
    for instance in redis.instances:
        if not instance.alive:
            instance.start()
    await asyncio.to_thread(redis.wait_ok)
    redis.flush()
    lease_key = LEASE_KEY
    slot = key_slot(lease_key.encode())
    victim = redis.owner(slot)
    lease = RedisLease(
        make_cluster_client(redis.url), lease_key, "holder", 15_000, through_failover=True
    )
    dedup = RedisClusterDedup(make_cluster_client(redis.url), failover_seconds=15)
    i = 0
    while redis.owner(key_slot(f"ap:sqs:m{i}".encode())) != victim:
        i += 1
    on_victim = f"ap:sqs:m{i}"
    try:
        assert await lease.renew() is LeaseState.ACQUIRED
        assert await dedup.claim([on_victim], "a", 30) == [Claim.CLAIMED]
        await asyncio.sleep(1.5)  # the replica has both keys (it acks every second)
        redis.instance(victim).kill()
        # Each call retries until the replica is promoted: no error, nothing lost.
        assert await lease.renew() is LeaseState.RENEWED
        assert lease.valid_until > time.monotonic()
        assert await dedup.claim([on_victim, "ap:sqs:other"], "b", 30) == [
            Claim.BUSY,
            Claim.CLAIMED,
        ]
        await dedup.complete([on_victim], 60)
        assert await dedup.claim([on_victim], "c", 30) == [Claim.DONE]
        assert redis.owner(slot) != victim
    finally:
        await lease.close()
        await dedup.close()
        redis.instance(victim).start()
        await asyncio.to_thread(redis.wait_ok)


async def test_a_game_slot_moved_between_primaries_keeps_delivery_gap_free(
    nodes: Cluster,
) -> None:
    """Resharding by hand (``SETSLOT IMPORTING/MIGRATING``, ``MIGRATE``,
    ``SETSLOT NODE``) while three nodes watch the game: events published before,
    during (retried through ``TRYAGAIN`` until the move is done) and after the
    move (``MOVED``) all arrive, once each, in order, at consecutive offsets, and
    every node listens on the new owner."""
    redis = nodes.redis
    assert isinstance(redis, RedisCluster)
    by_shard = one_game_per_shard(redis)
    source, game_id = next(iter(by_shard.items()))
    target = next(p for p in by_shard if p != source)
    channel = channel_for(f"game:chess#{game_id}")
    slot = key_slot(channel.encode())
    observers = [
        await nodes.client(n, f"obs-{n}", games=[("chess", game_id)], since={})
        for n in ("n1", "n2", "n3")
    ]
    await eventually(partial(subscribed_nodes_are, 3, source, channel), 5, "3 nodes on source")
    sent: list[str] = []

    async def publish(step: str) -> None:
        body = game("chess", game_id)
        body["payload"]["seen"] = f"{step}-{len(sent)}"
        assert await nodes.publish(("n1", "n2", "n3")[len(sent) % 3], body) == 202
        sent.append(body["payload"]["seen"])

    await publish("before")
    await asyncio.to_thread(redis.begin_migration, slot, source, target)
    # Every append names its event with a new key: over a slot being migrated,
    # Redis answers TRYAGAIN (a multi-key command whose keys are not all on one
    # side) on the source, and after ASK on the target, until the move is done.
    migrating = asyncio.create_task(publish("migrating"))
    await asyncio.sleep(0.5)
    assert not migrating.done()
    # meta, history, and the name of the event before
    assert await asyncio.to_thread(redis.move_keys, slot, source, target) == 3
    await asyncio.to_thread(redis.finish_migration, slot, target)
    await migrating  # retried through TRYAGAIN, then MOVED: it ran on the target once
    await publish("moved")  # MOVED: the nodes update their slot map
    await publish("after")
    assert redis.owner(slot) == target
    # The source dropped the slot's subscriptions (sunsubscribe); every node
    # subscribed again on the target.
    await eventually(partial(subscribed_nodes_are, 3, target, channel), 5 + SLACK, "3 on target")
    assert shard_subscribers(source, channel) == 0
    await publish("resubscribed")
    stream = f"game:chess#{game_id}"
    for observer in observers:
        await observer.wait_for(partial(got_more_than, observer, game_id, len(sent) - 1), 5 + SLACK)
        assert got(observer, game_id) == sent
        assert observer.offsets(stream) == list(range(1, len(sent) + 1))
        assert_no_gap(observer)
