"""The buses' pub/sub connection (server/redis/subscriber.py) against a real redis-server:
held messages, barriers, and every way a connection ends being reported."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from server.redis.client import subscriber_connection
from server.redis.subscriber import Push, Subscriber
from tests.services import RedisServer, start_redis_server
from tests.waiting import eventually


class Pushes:
    def __init__(self) -> None:
        self.got: list[Push] = []

    def __call__(self, push: Push) -> None:
        self.got.append(push)

    def messages(self) -> list[bytes]:
        return [push[2] for push in self.got if push[0] == b"message"]


@pytest.fixture
async def commands(fresh_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(host="127.0.0.1", port=fresh_redis.port)
    yield client
    await client.aclose()


async def opened(url: str, pushes: Pushes, *, keepalive: float = 5.0) -> Subscriber:
    subscriber = Subscriber(
        subscriber_connection(url, client_name="ap-sub:test"), pushes, keepalive=keepalive
    )
    await subscriber.open()
    return subscriber


async def test_the_streams_redis_py_keeps_private_are_there_after_connecting(
    fresh_redis: RedisServer,
) -> None:
    # Subscriber.open takes over these two after redis-py's handshake.
    connection = subscriber_connection(fresh_redis.url, client_name=None)
    await connection.connect()  # type: ignore[no-untyped-call]
    try:
        assert isinstance(connection._reader, asyncio.StreamReader)
        assert isinstance(connection._writer, asyncio.StreamWriter)
    finally:
        await connection.disconnect()


async def test_messages_are_held_until_release_then_delivered_in_order(
    fresh_redis: RedisServer, commands: aioredis.Redis
) -> None:
    pushes = Pushes()
    subscriber = await opened(fresh_redis.url, pushes)
    try:
        subscriber.send(("SUBSCRIBE", "a", "b"))
        await subscriber.barrier()
        for n in range(3):
            assert await commands.publish("a", f"held-{n}") == 1
        # A barrier after the publishes: they have reached this connection.
        await subscriber.barrier()
        assert pushes.got == []
        subscriber.release()
        assert [push[0] for push in pushes.got[:2]] == [b"subscribe", b"subscribe"]
        assert pushes.messages() == [b"held-0", b"held-1", b"held-2"]
        await commands.publish("b", "live")
        await eventually(lambda: pushes.messages()[-1:] == [b"live"], 10)
        assert pushes.got[-1] == [b"message", b"b", b"live"]
    finally:
        await subscriber.close()


async def test_a_resp2_connection_is_read_the_same_way(
    fresh_redis: RedisServer, commands: aioredis.Redis
) -> None:
    # Under RESP2 a PING on a subscribed connection answers [b"pong", token].
    pushes = Pushes()
    connection = Connection(host="127.0.0.1", port=fresh_redis.port, protocol=2)
    subscriber = Subscriber(connection, pushes, keepalive=5.0)
    await subscriber.open()
    try:
        subscriber.send(("SUBSCRIBE", "a"))
        await subscriber.barrier()
        subscriber.release()
        await commands.publish("a", "x")
        await eventually(lambda: pushes.messages() == [b"x"], 10)
    finally:
        await subscriber.close()


async def test_a_barrier_before_any_subscription_is_answered(fresh_redis: RedisServer) -> None:
    subscriber = await opened(fresh_redis.url, Pushes())
    try:
        await subscriber.barrier()  # a plain PING reply, not in subscribed mode yet
        assert not subscriber.failed
    finally:
        await subscriber.close()


async def test_a_killed_connection_ends_run_and_fails_a_waiting_barrier(
    fresh_redis: RedisServer, commands: aioredis.Redis
) -> None:
    subscriber = await opened(fresh_redis.url, Pushes())
    try:
        subscriber.send(("SUBSCRIBE", "a"))
        await subscriber.barrier()
        assert await commands.client_kill_filter(_type="pubsub") == 1
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(subscriber.run(), 10)
        assert subscriber.failed
        with pytest.raises(RedisConnectionError):
            subscriber.send(("SUBSCRIBE", "b"))
        with pytest.raises(RedisConnectionError):
            await subscriber.barrier()
    finally:
        await subscriber.close()


async def test_an_error_reply_ends_the_connection(fresh_redis: RedisServer) -> None:
    subscriber = await opened(fresh_redis.url, Pushes())
    try:
        subscriber.send(("SUBSCRIBE",))  # no channel: Redis answers with an error
        with pytest.raises(ResponseError):
            await asyncio.wait_for(subscriber.run(), 10)
    finally:
        await subscriber.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own: it is frozen with SIGSTOP."""
    server = start_redis_server()
    try:
        yield server
    finally:
        if server.process is not None:
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


async def test_a_frozen_redis_is_found_by_the_keepalive(own_redis: RedisServer) -> None:
    # The TCP connection stays up: only the unanswered pings tell.
    subscriber = await opened(own_redis.url, Pushes(), keepalive=0.2)
    try:
        subscriber.send(("SUBSCRIBE", "a"))
        await subscriber.barrier()
        assert own_redis.process is not None
        os.kill(own_redis.process.pid, signal.SIGSTOP)
        with pytest.raises(TimeoutError, match="no answer from Redis"):
            await asyncio.wait_for(subscriber.run(), 30)
    finally:
        await subscriber.close()


async def test_a_quiet_but_live_connection_is_kept(fresh_redis: RedisServer) -> None:
    subscriber = await opened(fresh_redis.url, Pushes(), keepalive=0.5)
    try:
        subscriber.send(("SUBSCRIBE", "a"))
        await subscriber.barrier()
        # Past twice the keepalive with nothing published: the pings' answers keep it.
        quiet_since = subscriber.last_seen
        await eventually(lambda: subscriber.last_seen > quiet_since + 1.2, 30)
        assert not subscriber.failed
    finally:
        await subscriber.close()
