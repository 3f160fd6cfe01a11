"""Every append is idempotent: a script resent after its connection was cut
(it ran, its caller never heard) is appended once, on one Redis and on a Redis
Cluster, with the position of the first run; and so is a publisher's retry
after a 503, whether the append it retries ran or not.

The cut comes from :class:`~loadtest.harness.faults.TcpFaultProxy`: it lets the
``EVALSHA`` reach Redis, then resets the client's connection before the reply.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot

from loadtest.harness.faults import TcpFaultProxy
from loadtest.harness.redis_cluster import RedisCluster
from loadtest.harness.servers import HOST
from server.bus.redis_streams import RedisStreams, event_id_key, history_key
from server.bus.streams import DEFAULT_LIMITS, NOTIFICATION_NAME, OWN_NAME, Append, new_event_id
from server.redis.shard_pipes import ShardPipes
from tests.conftest import TEST_SETTINGS, run_server
from tests.services import RedisServer


async def history_of(url: str, stream: str) -> list[tuple[bytes, bytes]]:
    client = aioredis.Redis.from_url(url)
    try:
        entries: Any = await client.xrange(history_key(stream))
    finally:
        await client.aclose()
    return [(bytes(entry_id), bytes(fields[b"d"])) for entry_id, fields in entries]


async def test_an_append_resent_after_a_cut_is_appended_once(
    fresh_redis: RedisServer, redis_proxy: TcpFaultProxy
) -> None:
    streams = RedisStreams(redis_proxy.url)
    stream = f"game:chess#{uuid.uuid4().hex[:8]}"
    try:
        await streams.start()
        first = await streams.append(stream, b"one", (stream,))
        redis_proxy.cut_after(b"EVALSHA")
        second = await streams.append(stream, b"two", (stream,))  # no name given
        assert redis_proxy.cuts_after_write == 1
        third = await streams.append(stream, b"three", (stream,))
    finally:
        await streams.close()
    assert [first.offset, second.offset, third.offset] == [1, 2, 3]
    assert await history_of(fresh_redis.url, stream) == [
        (b"1-0", b"one"),
        (b"2-0", b"two"),
        (b"3-0", b"three"),
    ]


async def test_a_pipeline_resent_after_a_cut_appends_each_event_once(
    fresh_redis: RedisServer, redis_proxy: TcpFaultProxy
) -> None:
    streams = RedisStreams(redis_proxy.url)
    stream = f"game:go#{uuid.uuid4().hex[:8]}"
    try:
        await streams.start()
        await streams.append(stream, b"warm", (stream,))  # the script is loaded
        redis_proxy.cut_after(b"EVALSHA")
        items = [Append(stream, b"e%d" % i, (stream,)) for i in range(5)]
        positions = await streams.append_many(items)
        assert redis_proxy.cuts_after_write == 1
    finally:
        await streams.close()
    assert [p.offset for p in positions] == [2, 3, 4, 5, 6]
    data = [d for _, d in await history_of(fresh_redis.url, stream)]
    assert data == [b"warm", b"e0", b"e1", b"e2", b"e3", b"e4"]


async def test_a_cluster_append_resent_by_the_shard_pipes_is_appended_once(
    shared_redis_cluster: RedisCluster,
) -> None:
    """The shard's connection dies after the script was written: ShardPipes
    re-reads the slot map and resends, as through a failover."""
    redis = shared_redis_cluster
    redis.wait_ok()
    proxies: dict[int, TcpFaultProxy] = {}
    for instance in redis.instances:
        proxies[instance.port] = TcpFaultProxy(instance.port)
        await proxies[instance.port].start()

    def through_proxy(address: tuple[str, int]) -> tuple[str, int]:
        made = proxies.get(address[1])
        return (HOST, made.port) if made is not None else address

    client = ClusterClient(
        startup_nodes=None,
        host=HOST,
        port=proxies[redis.instances[0].port].port,
        address_remap=through_proxy,
    )
    pipes = ShardPipes(client)
    streams = RedisStreams(redis.url, pipes=pipes)
    stream = f"game:shogi#{uuid.uuid4().hex[:8]}"
    owner = redis.owner(key_slot(("ap:{" + stream + "}").encode()))
    try:
        await streams.start()
        first = await streams.append(stream, b"one", (stream,))
        proxies[owner].cut_after(b"EVALSHA")
        second = await streams.append(stream, b"two", (stream,))
        assert proxies[owner].cuts_after_write == 1
        third = await streams.append(stream, b"three", (stream,))
    finally:
        await pipes.close()
        await client.aclose()
        for made in proxies.values():
            await made.stop()
    assert [first.offset, second.offset, third.offset] == [1, 2, 3]
    direct = aioredis.Redis(host=HOST, port=owner)
    try:
        entries: Any = await direct.xrange(history_key(stream))
    finally:
        await direct.aclose()
    assert [bytes(fields[b"d"]) for _, fields in entries] == [b"one", b"two", b"three"]


async def test_each_name_is_kept_for_its_window(fresh_redis: RedisServer) -> None:
    """Names made here only come back through our own retries (5 min), a
    notification's as long as its push's dedup (24 h), others 15 min."""
    streams = RedisStreams(fresh_redis.url)
    stream = f"user:{uuid.uuid4().hex[:8]}"
    own, notification = new_event_id(), NOTIFICATION_NAME + "1700000000000#abc"
    client = aioredis.Redis.from_url(fresh_redis.url)
    try:
        await streams.start()
        await streams.append(stream, b"a", (), own)
        await streams.append(stream, b"b", (), "sqs-message-id")
        await streams.append(stream, b"c", (), notification)
        await streams.append(stream, b"d", ())
        ttls = [
            await client.ttl(event_id_key(stream, name))
            for name in (own, "sqs-message-id", notification)
        ]
        named_here = [k async for k in client.scan_iter(event_id_key(stream, OWN_NAME + "*"))]
    finally:
        await client.aclose()
        await streams.close()
    limits = DEFAULT_LIMITS
    assert (limits.resend_id_ttl, limits.event_id_ttl, limits.notification_id_ttl) == (
        300,
        900,
        24 * 3600,
    )
    assert 250 < ttls[0] <= 300 and 850 < ttls[1] <= 900 and 86000 < ttls[2] <= 86400
    assert len(named_here) == 2  # the unnamed append got a name of its own


def move(n: int) -> dict[str, Any]:
    return {"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": n}}


async def test_a_publisher_told_503_retries_with_its_key_and_each_event_is_delivered_once(
    redis_proxy: TcpFaultProxy,
) -> None:
    """``POST /publish`` answers 503 when the append failed, and the publisher
    retries with the same ``Idempotency-Key``: whether Redis never saw the append
    (its connection reset first, and the resend's) or ran it and the replies were
    lost, the retry is answered with the event's one position, and the tab hears
    each event once."""
    settings = dataclasses.replace(TEST_SETTINGS, redis_url=redis_proxy.url)
    game = "game:chess#g1"
    async with run_server(settings) as server:
        watcher = await server.subscribed("alice", games=[("chess", "g1")], since={})
        answers = []
        for n, key, cut in (
            (1, "never-ran", redis_proxy.cut_before),
            (2, "ran", redis_proxy.cut_after),
        ):
            headers = {"Idempotency-Key": key}
            cut(key.encode(), 2)  # the append and the pipe's one resend
            status, reply = await server.publish(move(n), headers=headers)
            assert (status, reply) == (503, {"error": "the bus could not take the event"})
            status, reply = await server.publish(move(n), headers=headers)
            assert status == 202 and isinstance(reply, dict)
            answers.append(reply["positions"][game]["offset"])
        assert (redis_proxy.cuts_before_write, redis_proxy.cuts_after_write) == (2, 2)
        assert answers == [1, 2]
        await watcher.wait_for(lambda: len(watcher.offsets(game)) == 2)
        await watcher.barrier()
        assert watcher.offsets(game) == [1, 2]
        assert [frame["payload"]["n"] for frame in watcher.on_stream(game)] == [1, 2]
