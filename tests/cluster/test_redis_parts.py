"""The Redis bus and the cluster presence backend in-process, against a real redis-server.

The cluster tests drive them through whole nodes; these pin down the edges
that are hard to reach from outside: reconnect order, fencing, stale commits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgpack
import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from loadtest.harness.faults import TcpFaultProxy
from loadtest.harness.redis_cluster import RedisCluster, redis_cli
from protocol.envelope import PresenceHint, decode_envelope
from protocol.messages import PresenceDelta
from server.bus.base import BusDown
from server.bus.redis_bus import BusUnavailable, RedisBus
from server.bus.redis_cluster_bus import RedisClusterBus
from server.bus.topics import PRESENCE, PRESENCE_HINTS
from server.presence.core import Changes, delta_of
from server.presence.redis import RedisPresenceBackend
from server.redis.keys import PRESENCE_NAMESPACE, channel_for
from server.runtime.metrics import Registry
from server.store.memory import MemoryStore
from tests.client import PATIENCE
from tests.services import RedisServer, free_port
from tests.waiting import eventually


@pytest.fixture
def redis_server(fresh_redis: RedisServer) -> RedisServer:
    return fresh_redis


class Inbox:
    def __init__(self) -> None:
        self.got: list[tuple[str, bytes]] = []

    def __call__(self, topic: str, data: bytes) -> None:
        self.got.append((topic, data))

    def on(self, topic: str) -> list[bytes]:
        return [data for t, data in self.got if t == topic]


@pytest.fixture
async def buses(redis_server: RedisServer) -> AsyncIterator[list[tuple[RedisBus, Inbox]]]:
    made: list[tuple[RedisBus, Inbox]] = []
    for _ in range(2):
        bus, inbox = RedisBus(redis_server.url, max_backoff=0.2), Inbox()
        await bus.start(inbox)
        made.append((bus, inbox))
    yield made
    for bus, _ in made:
        await bus.close()


def test_channels_keep_presence_in_one_slot_and_games_apart() -> None:
    assert channel_for(PRESENCE) == "ap:{presence}:deltas"
    assert channel_for(PRESENCE_HINTS) == "ap:{presence}:hints"
    assert channel_for("game:chess#g1") == "ap:{game:chess#g1}"
    assert channel_for("admin") == "ap:{admin}"


async def test_start_fails_cleanly_without_redis() -> None:
    bus = RedisBus(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.5)
    with pytest.raises(BusUnavailable):
        await bus.start(Inbox())
    assert not bus.connected


async def test_a_cluster_bus_start_fails_cleanly_without_redis() -> None:
    """A wrong ``--redis-url``: a clear error naming it, and nothing left running."""
    url = f"redis://127.0.0.1:{free_port()}"
    bus = RedisClusterBus(url, connect_timeout=0.5)
    before = asyncio.all_tasks()
    with pytest.raises(BusUnavailable, match=f"Redis Cluster at {url} did not answer within 0.5s"):
        await bus.start(Inbox())
    assert not bus.connected
    assert asyncio.all_tasks() - before == set()  # the repair loop is gone too


async def test_the_bus_survives_a_redis_restart(
    redis_server: RedisServer, buses: list[tuple[RedisBus, Inbox]]
) -> None:
    (a, inbox_a), (b, inbox_b) = buses
    reconnects: list[bool] = []
    a.on_reconnect(lambda: reconnects.append(a.connected))
    await a.subscribe(["t"])
    await b.subscribe(["t"])

    redis_server.stop()
    await eventually(lambda: not a.connected and not b.connected, 5, "the outage noticed")
    # While Redis is away each bus still delivers to itself, and only to itself.
    await a.publish("t", b"local")
    await eventually(lambda: inbox_a.on("t") == [b"local"], 2, "local delivery")
    await a.subscribe(["added-while-down"])

    redis_server.start()
    await eventually(lambda: a.connected and b.connected, 5, "the reconnect")
    assert reconnects == [True], "the callback ran once, after resubscribing"
    await b.publish("t", b"after")
    await b.publish("added-while-down", b"new")
    await eventually(lambda: inbox_a.on("added-while-down") == [b"new"], 2, "new topic")
    assert inbox_a.on("t") == [b"local", b"after"]
    assert inbox_b.on("t") == [b"after"]


async def test_reconnect_callbacks_run_before_any_new_message(
    redis_server: RedisServer, buses: list[tuple[RedisBus, Inbox]]
) -> None:
    _, (publisher, _) = buses
    order: list[str] = []
    bus = RedisBus(redis_server.url, max_backoff=0.2)
    await bus.start(lambda topic, data: order.append(data.decode()))
    try:
        bus.on_reconnect(lambda: order.append("reconnected"))
        await bus.subscribe(["t"])
        redis_server.stop()
        await eventually(lambda: not publisher.connected, 5, "the outage noticed")
        redis_server.start()
        # Publish as soon as Redis is back, likely before bus has resubscribed.
        await eventually(lambda: publisher.connected, 5, "the publisher back")
        for i in range(500):
            await publisher.publish("t", str(i).encode())
            await asyncio.sleep(0.01)
            if bus.connected and len(order) > 1:
                break
        await publisher.publish("t", b"last")
        await eventually(lambda: "last" in order, 5, "the bus back")
        assert order.index("reconnected") == 0
    finally:
        await bus.close()


async def test_a_publish_lost_on_its_way_while_the_subscriber_holds(
    redis_proxy: TcpFaultProxy,
) -> None:
    """The bus is attached, but a publish's own connection fails, and so does
    redis-py's one retry. By default the message still reaches this node's
    subscribers, and only them, counted; a caller that must reach the cluster
    hears ``BusDown`` and nothing is delivered anywhere."""
    inbox, metrics = Inbox(), Registry()
    bus = RedisBus(redis_proxy.url, metrics=metrics)
    await bus.start(inbox)
    try:
        await bus.subscribe(["t"])
        redis_proxy.cut_before(b"PUBLISH", 2)
        await bus.publish("t", b"here only")
        assert redis_proxy.cuts_before_write == 2
        assert bus.connected  # the subscriber's connection was never touched
        await eventually(lambda: inbox.on("t") == [b"here only"], 5, "local delivery")
        assert metrics.value("ap_bus_local_only_publishes_total") == 1

        redis_proxy.cut_before(b"PUBLISH", 2)
        with pytest.raises(BusDown):
            await bus.publish("t", b"nowhere", local_fallback=False)
        # Through Redis again; had "nowhere" gone anywhere, it would come first.
        await bus.publish("t", b"through Redis", local_fallback=False)
        await eventually(lambda: len(inbox.on("t")) == 2, 5, "the next publish")
        assert inbox.on("t") == [b"here only", b"through Redis"]
        assert metrics.value("ap_bus_local_only_publishes_total") == 1
    finally:
        await bus.close()


async def test_a_spublish_its_primary_holds_reaches_this_node_at_once(
    shared_redis_cluster: RedisCluster,
) -> None:
    """The Redis Cluster bus's fallback: the primary that owns the topic's slot
    holds every write (``CLIENT PAUSE ... WRITE``, as a primary that stops
    answering would), so the ``SPUBLISH`` stalls past its deadline. By default the
    message reaches this node's subscribers at once, counted; a caller that must
    reach the cluster hears ``BusDown``. The subscriptions, which only read, hold.

    A stalled ``SPUBLISH`` is not known to have failed: the primary runs it once
    it answers again (its connection closed or not), so the copy given here may
    come again. Only unpositioned admin messages take this path in cluster mode."""
    topic = "game:chess#spublish-fallback"
    owner = shared_redis_cluster.owner(key_slot(channel_for(topic).encode()))
    here, elsewhere, metrics = Inbox(), Inbox(), Registry()
    bus = RedisClusterBus(
        shared_redis_cluster.url, publish_deadline=0.2, stall_timeout=0.3, metrics=metrics
    )
    other = RedisClusterBus(shared_redis_cluster.url)
    await bus.start(here)
    await other.start(elsewhere)
    try:
        await bus.subscribe([topic])
        await other.subscribe([topic])
        redis_cli(owner, "CLIENT", "PAUSE", "60000", "WRITE")
        try:
            await bus.publish(topic, b"here at once")
            await eventually(
                lambda: here.on(topic) == [b"here at once"], PATIENCE, "local delivery"
            )
            assert metrics.value("ap_bus_local_only_publishes_total") == 1
            with pytest.raises(BusDown):
                await bus.publish(topic, b"required", local_fallback=False)
            assert bus.connected and other.connected
            assert here.on(topic) == [b"here at once"] and elsewhere.on(topic) == []
        finally:
            redis_cli(owner, "CLIENT", "UNPAUSE")
        # Through the primary again, after the stalled ones (from the other bus: this
        # one's 0.2 s deadline is for the stall, too short for a loaded machine).
        await other.publish(topic, b"through Redis", local_fallback=False)
        for inbox in (here, elsewhere):
            await eventually(lambda i=inbox: b"through Redis" in i.on(topic), PATIENCE, "it")  # type: ignore[misc]
            assert inbox.on(topic)[-1] == b"through Redis"
            assert set(inbox.on(topic)) <= {b"here at once", b"required", b"through Redis"}
        assert metrics.value("ap_bus_local_only_publishes_total") == 1
    finally:
        await bus.close()
        await other.close()


async def test_a_subscription_redis_is_slow_to_confirm_is_kept_and_served(
    redis_proxy: TcpFaultProxy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis takes the ``SUBSCRIBE`` but its answers are held past the confirm
    timeout: the caller is not failed (a slow Redis is not a refused topic), the
    operator is told, the topic stays subscribed, and its messages arrive once
    Redis answers again."""
    monkeypatch.setattr("server.redis.subscriber.CONFIRM_TIMEOUT_S", 0.3)
    inbox = Inbox()
    bus = RedisBus(redis_proxy.url)
    await bus.start(inbox)
    try:
        redis_proxy.hold_replies()
        await asyncio.wait_for(bus.subscribe(["slow"]), 5)
        assert bus.connected
        assert "Redis did not confirm a subscription" in caplog.text
        redis_proxy.heal()
        await bus.publish("slow", b"after the confirm", local_fallback=False)
        await eventually(lambda: inbox.on("slow") == [b"after the confirm"], 5, "delivery")
    finally:
        await bus.close()


LEASE_MS = 60_000
"""Longer than any test: a lease lapses only when a test makes it (``lapse``), never
because a loaded machine took 400 ms between two steps."""

Backends = tuple[RedisPresenceBackend, RedisPresenceBackend, Inbox, "RedisBus | RedisClusterBus"]


@pytest.fixture(params=["redis", "redis-cluster"])
async def backends(request: pytest.FixtureRequest) -> AsyncIterator[Backends]:
    """Two presence backends on one bus: over one Redis, and over a Redis Cluster."""
    store = MemoryStore()
    bus: RedisBus | RedisClusterBus
    if request.param == "redis-cluster":
        cluster: RedisCluster = request.getfixturevalue("shared_redis_cluster")
        cluster.flush()
        bus = RedisClusterBus(cluster.url)
    else:
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        bus = RedisBus(redis_server.url)
    inbox = Inbox()
    await bus.start(inbox)
    await bus.subscribe([PRESENCE, PRESENCE_HINTS])
    one = RedisPresenceBackend(bus, store, node_id="one", lease_ms=LEASE_MS)
    two = RedisPresenceBackend(bus, store, node_id="two", lease_ms=LEASE_MS)
    for backend in (one, two):
        await backend.start()
    yield one, two, inbox, bus
    for backend in (one, two):
        await backend.close()
    await bus.close()


async def lapse(bus: RedisBus | RedisClusterBus) -> None:
    """What a lease holder that stopped renewing leaves: no lease key (it expired)."""
    client = bus.command_client()
    try:
        assert await client.delete(PRESENCE_NAMESPACE + "leader") == 1
    finally:
        await client.aclose()


async def test_one_writer_and_a_fenced_stale_one(backends: Backends) -> None:
    one, two, inbox, bus = backends
    assert await one.lead()
    assert not await two.lead()
    await one.report({"alice": True}, time.time())
    await two.report({"alice": False, "bob": False}, time.time())
    live = await one.online(None)
    assert live == {"alice": True, "bob": False}, "visible on any node is visible"
    committed = await one.committed()
    changes: Changes = {"alice": True, "bob": False}
    delta = delta_of(committed.seq + 1, committed.users, changes)
    assert not await two.commit(delta, changes), "only the lease holder commits"
    assert await one.commit(delta, changes)
    await eventually(lambda: len(inbox.on(PRESENCE)) == 1, 2, "the delta published")
    assert decode_envelope(inbox.on(PRESENCE)[0]) == delta
    assert (await two.committed()).users == {"alice": True, "bob": False}

    # The lease lapses (one stops renewing): two takes over, one is fenced.
    await lapse(bus)
    assert await two.lead()
    assert not await one.lead()
    leave = delta_of(delta.seq + 1, {"alice": True, "bob": False}, {"alice": None})
    assert not await one.commit(leave, {"alice": None})
    assert await two.commit(leave, {"alice": None})
    assert len(inbox.on(PRESENCE)) >= 1
    await eventually(lambda: len(inbox.on(PRESENCE)) == 2, 2, "only two deltas")
    hints = [decode_envelope(data) for data in inbox.on(PRESENCE_HINTS)]
    assert all(isinstance(h, PresenceHint) for h in hints)


async def test_a_commit_that_does_not_match_redis_is_refused(backends: Backends) -> None:
    one, _, inbox, _ = backends
    assert await one.lead()
    base = await one.committed()
    good = delta_of(base.seq + 1, {}, {"alice": True})
    assert await one.commit(good, {"alice": True})
    # The same seq again, or an older one: refused.
    assert not await one.commit(good, {"alice": True})
    # A writer whose copy missed alice's join computes a wrong total: refused.
    wrong = delta_of(base.seq + 2, {}, {"bob": True})
    assert not await one.commit(wrong, {"bob": True})
    # A writer that thinks alice was invisible would not send her leave: refused.
    no_leave = PresenceDelta(seq=base.seq + 2, joins=(), leaves=(), total_count=0)
    assert not await one.commit(no_leave, {"alice": None})
    right = delta_of(base.seq + 2, {"alice": True}, {"alice": None})
    assert await one.commit(right, {"alice": None})
    await eventually(lambda: len(inbox.on(PRESENCE)) == 2, 2, "two deltas")
    assert [decode_envelope(d) for d in inbox.on(PRESENCE)] == [good, right]


async def test_hints_built_in_lua_are_envelopes(backends: Backends) -> None:
    one, _, inbox, _ = backends
    await one.report({"alice": True, "bob": False}, time.time())
    await one.close()  # deregistering hints the users it withdraws, from Lua
    await eventually(lambda: len(inbox.on(PRESENCE_HINTS)) >= 2, 2, "the hints")
    last = inbox.on(PRESENCE_HINTS)[-1]
    assert msgpack.unpackb(last)["v"] == 1
    hint = decode_envelope(last)
    assert isinstance(hint, PresenceHint)
    assert hint.node_id == "one"
    assert sorted(hint.user_ids) == ["alice", "bob"]


async def test_committed_seq_is_the_seq_a_commit_left(backends: Backends) -> None:
    one, _, _, _ = backends
    assert await one.lead()
    committed = await one.committed()
    assert await one.committed_seq() == committed.seq
    changes: Changes = {"alice": True}
    assert await one.commit(delta_of(committed.seq + 1, committed.users, changes), changes)
    assert await one.committed_seq() == committed.seq + 1


async def test_a_recheck_subscribes_the_topics_shard_anew_and_delivery_goes_on(
    shared_redis_cluster: RedisCluster,
) -> None:
    """What a node does when its view check finds a delta it never heard: the
    topic's shard is dropped and attached again on a fresh connection, then the
    reconnect callbacks run (presence reload, held streams checked)."""
    inbox = Inbox()
    metrics = Registry()
    bus = RedisClusterBus(shared_redis_cluster.url, metrics=metrics)
    await bus.start(inbox)
    repaired: list[bool] = []
    bus.on_reconnect(lambda: repaired.append(bus.connected))
    try:
        await bus.subscribe([PRESENCE, PRESENCE_HINTS])
        home = bus.shard_of(PRESENCE)
        bus.recheck(PRESENCE)
        assert metrics.value("ap_bus_shard_losses_total") == 1
        await eventually(lambda: repaired == [True], 10, "the repair's callbacks")
        assert bus.shard_of(PRESENCE) == home  # the same owner, on a new connection
        await bus.publish(PRESENCE, b"after the recheck", local_fallback=False)
        await eventually(lambda: inbox.on(PRESENCE) == [b"after the recheck"], 10, "delivery")
    finally:
        await bus.close()


async def test_a_recheck_on_one_redis_subscribes_anew_and_delivery_goes_on(
    redis_server: RedisServer,
) -> None:
    """The same on one Redis, where one connection holds every topic: it is
    replaced, every topic subscribed again, then the reconnect callbacks run."""
    inbox = Inbox()
    metrics = Registry()
    bus = RedisBus(redis_server.url, max_backoff=0.2, name="recheck", metrics=metrics)
    await bus.start(inbox)
    repaired: list[bool] = []
    bus.on_reconnect(lambda: repaired.append(bus.connected))
    try:
        await bus.subscribe([PRESENCE, "game:chess#recheck"])
        before = await sub_connection_ids(redis_server, "ap-sub:recheck")
        bus.recheck("game:chess#recheck")
        await eventually(lambda: repaired == [True], 10, "the reconnect's callbacks")
        assert metrics.value("ap_bus_reconnects_total") == 1
        after = await sub_connection_ids(redis_server, "ap-sub:recheck")
        assert len(after) == 1 and after != before  # a fresh connection
        topics = (PRESENCE, "game:chess#recheck")
        for topic in topics:
            await bus.publish(topic, b"after the recheck", local_fallback=False)
        expected = {topic: [b"after the recheck"] for topic in topics}
        heard = lambda: {topic: inbox.on(topic) for topic in topics} == expected  # noqa: E731
        await eventually(heard, 10, "delivery on every topic")
    finally:
        await bus.close()


async def sub_connection_ids(redis_server: RedisServer, name: str) -> list[str]:
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        listing = await client.client_list()
    finally:
        await client.aclose()
    return [str(entry["id"]) for entry in listing if entry.get("name") == name]
