"""One pipelined Redis connection, its replies parsed where they arrive, on a
real ``redis-server`` (and :class:`~loadtest.harness.faults.TcpFaultProxy` for
faults)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from loadtest.harness.faults import TcpFaultProxy
from server.redis.pipe import Pipe
from tests.services import RedisServer

Runner = Callable[[Coroutine[Any, Any, Any]], Any]
LOOPS: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


def test_redis_pys_connection_still_has_the_streams_the_pipe_takes_over(
    fresh_redis: RedisServer,
) -> None:
    async def check() -> None:
        connection = Connection(port=fresh_redis.port)
        await connection.connect()  # type: ignore[no-untyped-call]
        try:
            reader, writer = connection._reader, connection._writer
            assert isinstance(reader, asyncio.StreamReader)
            assert isinstance(reader._buffer, bytearray)  # type: ignore[attr-defined]
            assert isinstance(writer, asyncio.StreamWriter)
            assert callable(writer.transport.set_protocol)
        finally:
            await connection.disconnect()

    asyncio.run(check())


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_replies_come_back_in_order_with_redis_pys_errors(
    fresh_redis: RedisServer, loop: str
) -> None:
    async def check() -> None:
        pipe = Pipe(Connection(port=fresh_redis.port), "test")
        try:
            futures = pipe.submit(
                ("SET", "pipe:k", "v"),
                ("GET", "pipe:k"),
                ("EVALSHA", "0" * 40, 0),
                ("INCR", "pipe:k"),
                ("RPUSH", "pipe:list", *range(1000)),
            )
            later = pipe.submit(("LRANGE", "pipe:list", 998, -1))
            outcomes = await asyncio.gather(*futures, *later, return_exceptions=True)
        finally:
            await pipe.close()
        assert outcomes[:2] == [b"OK", b"v"]
        assert isinstance(outcomes[2], NoScriptError)
        assert type(outcomes[3]) is ResponseError
        assert outcomes[4:] == [1000, [b"998", b"999"]]

    LOOPS[loop](check())


def test_replies_are_decoded_when_the_connection_decodes(fresh_redis: RedisServer) -> None:
    async def check() -> list[Any]:
        pipe = Pipe(Connection(port=fresh_redis.port, decode_responses=True), "test")
        try:
            return list(
                await asyncio.gather(*pipe.submit(("SET", "pipe:d", "é"), ("GET", "pipe:d")))
            )
        finally:
            await pipe.close()

    assert asyncio.run(check()) == ["OK", "é"]


async def connected(proxy: TcpFaultProxy, stall_timeout: float = 5.0) -> Pipe:
    pipe = Pipe(Connection(port=proxy.port), "test", stall_timeout)
    assert await pipe.submit(("PING",))[0] == b"PONG"  # the handshake is done
    return pipe


async def test_one_turns_commands_go_out_in_one_write(redis_proxy: TcpFaultProxy) -> None:
    pipe = await connected(redis_proxy)
    try:
        requests = redis_proxy.record_round_trips()
        futures = [*pipe.submit(("SET", "pipe:a", "1")), *pipe.submit(("INCR", "pipe:a"))]
        futures += pipe.submit(("GET", "pipe:a"))
        assert await asyncio.gather(*futures) == [b"OK", 2, b"2"]
        assert len(requests) == 1
        assert b"SET" in requests[0] and b"INCR" in requests[0] and b"GET" in requests[0]
    finally:
        await pipe.close()


async def test_a_lost_connection_fails_every_command_outstanding(
    redis_proxy: TcpFaultProxy,
) -> None:
    pipe = await connected(redis_proxy)
    try:
        redis_proxy.hold_replies()
        futures = pipe.submit(("INCR", "pipe:n"), ("INCR", "pipe:n"))
        await asyncio.sleep(0)  # written
        assert redis_proxy.cut() == 1
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        assert all(isinstance(outcome, RedisConnectionError) for outcome in outcomes)
        assert pipe.dead
        (after,) = pipe.submit(("PING",))
        assert after.done() and isinstance(after.exception(), RedisConnectionError)
    finally:
        await pipe.close()


async def test_a_connection_that_stops_answering_is_given_up_on(
    redis_proxy: TcpFaultProxy,
) -> None:
    pipe = await connected(redis_proxy, stall_timeout=0.3)
    try:
        redis_proxy.hold_replies()
        (reply,) = pipe.submit(("PING",))
        with pytest.raises(RedisTimeoutError):
            await reply
        assert pipe.dead
    finally:
        await pipe.close()


async def test_a_handshake_never_answered_is_given_up_on(redis_proxy: TcpFaultProxy) -> None:
    redis_proxy.blackhole()  # the TCP connection is taken, nothing passes
    pipe = Pipe(Connection(port=redis_proxy.port), "test", stall_timeout=0.3)
    try:
        (reply,) = pipe.submit(("PING",))
        with pytest.raises(RedisTimeoutError):
            await reply
        assert pipe.dead
    finally:
        redis_proxy.heal()
        await pipe.close()
