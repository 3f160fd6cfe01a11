"""Script calls of concurrent callers, one write per round trip, on a real Redis.

Faults come from :class:`~loadtest.harness.faults.TcpFaultProxy` in front of
the worker's ``redis-server``: replies held back, connections cut after a
command reached Redis, and Redis restarted."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, ResponseError

from loadtest.harness.faults import TcpFaultProxy
from server.bus.redis_streams import RedisStreams
from server.redis.coalesce import ScriptCoalescer
from tests.services import RedisServer, redis_url_for_tests
from tests.waiting import eventually_in_thread

HANG_GUARD_S = 30.0

INCR_BY = """
local value = redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[1])
return value
"""
"""KEYS: counter, log. ARGV: amount (a non-number fails this call only)."""


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_url_for_tests() as url:
        yield url


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def coalescer(client: aioredis.Redis) -> AsyncIterator[ScriptCoalescer]:
    coalescer = ScriptCoalescer(client, INCR_BY)
    try:
        yield coalescer
    finally:
        await coalescer.close()


def fresh_keys() -> tuple[str, str]:
    """INCR_BY's counter and log, new to this Redis."""
    return f"n:{uuid.uuid4().hex}", f"log:{uuid.uuid4().hex}"


async def test_calls_issued_at_once_run_in_issue_order(redis_url: str) -> None:
    streams = RedisStreams(redis_url)
    stream = f"game:coalesce#{uuid.uuid4().hex[:8]}"
    try:
        positions = await asyncio.gather(
            *(streams.append(stream, f"e{i}".encode(), ()) for i in range(300))
        )
        assert [p.offset for p in positions] == list(range(1, 301))
        entries = (await streams.read(stream, 250)).entries
        assert entries[0] == (251, b"e250") and entries[-1] == (300, b"e299")
    finally:
        await streams.close()


async def test_one_callers_error_fails_that_caller_only(
    client: aioredis.Redis, coalescer: ScriptCoalescer
) -> None:
    key, log = fresh_keys()
    results = await asyncio.gather(
        coalescer.run([([key, log], [1]), ([key, log], [2])]),
        coalescer.run([([key, log], ["not a number"])]),
        coalescer.run([([key, log], [4])]),
        return_exceptions=True,
    )
    assert results[0] == [1, 3] and results[2] == [7]
    assert isinstance(results[1], ResponseError)
    assert await client.lrange(log, 0, -1) == [b"1", b"2", b"4"]
    with pytest.raises(ResponseError):  # alone in its turn, the same
        await coalescer.run([([key, log], ["not a number"])])


async def test_a_call_redis_cannot_take_fails_and_the_next_ones_run(
    client: aioredis.Redis, coalescer: ScriptCoalescer
) -> None:
    key, log = fresh_keys()
    with pytest.raises(DataError):
        await asyncio.wait_for(coalescer.run([([key, log], [None])]), HANG_GUARD_S)
    assert await asyncio.wait_for(coalescer.run([([key, log], [5])]), HANG_GUARD_S) == [5]
    assert await client.lrange(log, 0, -1) == [b"5"]


async def test_a_call_redis_cannot_take_fails_only_its_caller_among_others(
    client: aioredis.Redis, coalescer: ScriptCoalescer
) -> None:
    key, log = fresh_keys()
    results = await asyncio.wait_for(
        asyncio.gather(  # issued in one turn: one write
            coalescer.run([([key, log], [1]), ([key, log], [2])]),
            coalescer.run([([key, log], [3]), ([key, log], [None])]),
            coalescer.run([([key, log], [4])]),
            return_exceptions=True,
        ),
        HANG_GUARD_S,
    )
    assert results[0] == [1, 3] and results[2] == [7]
    assert isinstance(results[1], DataError)
    # None of the refused caller's calls ran, not even its sendable first one.
    assert await client.lrange(log, 0, -1) == [b"1", b"2", b"4"]


async def test_calls_run_again_after_the_script_cache_was_flushed(
    client: aioredis.Redis, coalescer: ScriptCoalescer
) -> None:
    key, log = fresh_keys()
    assert await coalescer.run([([key, log], [5])]) == [5]
    await client.script_flush()
    # NOSCRIPT: none of these ran, so each runs once after SCRIPT LOAD.
    assert await coalescer.run([([key, log], [1]), ([key, log], [1])]) == [6, 7]
    await client.script_flush()
    assert await coalescer.run([([key, log], [3])]) == [10]
    assert await client.lrange(log, 0, -1) == [b"5", b"1", b"1", b"3"]


@pytest.fixture
async def through_proxy(redis_proxy: TcpFaultProxy) -> AsyncIterator[ScriptCoalescer]:
    client = aioredis.Redis.from_url(redis_proxy.url)
    coalescer = ScriptCoalescer(client, INCR_BY)
    try:
        yield coalescer
    finally:
        redis_proxy.heal()
        await coalescer.close()
        await client.aclose()


def logged(redis_server: RedisServer, log: str) -> list[bytes]:
    """The script's log, read past the proxy."""
    with redis.Redis.from_url(redis_server.url) as direct:
        entries: list[bytes] = direct.lrange(log, 0, -1)
        return entries


async def a_call_unanswered(
    coalescer: ScriptCoalescer, proxy: TcpFaultProxy, redis_server: RedisServer, log: str
) -> tuple[str, asyncio.Task[list[Any]]]:
    """A call that has run in Redis while its reply is held back; its key."""
    key = f"n:{uuid.uuid4().hex}"
    assert await coalescer.run([([key, log], [1])]) == [1]
    proxy.hold_replies()
    call = asyncio.create_task(coalescer.run([([key, log], [2])]))
    await eventually_in_thread(
        lambda: logged(redis_server, log) == [b"1", b"2"], HANG_GUARD_S, "the call to run"
    )
    return key, call


async def test_calls_issued_while_a_write_is_answered_go_together_in_the_next(
    through_proxy: ScriptCoalescer, redis_proxy: TcpFaultProxy, fresh_redis: RedisServer
) -> None:
    log = f"log:{uuid.uuid4().hex}"
    key, first = await a_call_unanswered(through_proxy, redis_proxy, fresh_redis, log)
    requests = redis_proxy.record_round_trips()
    second = asyncio.create_task(through_proxy.run([([key, log], [4])]))
    await asyncio.sleep(0.05)
    third = asyncio.create_task(through_proxy.run([([key, log], [8])]))
    await asyncio.sleep(0.2)
    assert logged(fresh_redis, log) == [b"1", b"2"]  # nothing more while the first is out
    assert not requests
    redis_proxy.heal()
    assert [await first, await second, await third] == [[3], [7], [15]]
    assert len(requests) == 1  # one write, after the first one's reply
    assert b"$1\r\n4\r\n" in requests[0] and b"$1\r\n8\r\n" in requests[0]
    assert logged(fresh_redis, log) == [b"1", b"2", b"4", b"8"]


async def test_after_a_redis_restart_the_script_is_loaded_before_the_first_call(
    through_proxy: ScriptCoalescer, redis_proxy: TcpFaultProxy, fresh_redis: RedisServer
) -> None:
    key, log = fresh_keys()
    assert await through_proxy.run([([key, log], [1])]) == [1]
    await asyncio.to_thread(fresh_redis.restart)  # no persistence: the data and scripts are gone
    assert await through_proxy.run([([key, log], [2]), ([key, log], [3])]) == [2, 5]
    assert logged(fresh_redis, log) == [b"2", b"3"]
    with redis.Redis.from_url(fresh_redis.url) as direct:
        errors = direct.info("errorstats")
    assert "errorstat_NOSCRIPT" not in errors  # never asked for a script it lacked


async def test_a_call_cut_off_is_sent_once_more_then_fails_its_caller(
    through_proxy: ScriptCoalescer, redis_proxy: TcpFaultProxy, fresh_redis: RedisServer
) -> None:
    key, log = fresh_keys()
    assert await through_proxy.run([([key, log], [1])]) == [1]
    redis_proxy.cut_after(b"EVALSHA", count=1)
    # Cut once: resent on a new connection. (This script is not idempotent, as
    # an append is: the log shows each time it reached Redis.)
    assert await through_proxy.run([([key, log], [10])]) == [21]
    assert logged(fresh_redis, log) == [b"1", b"10", b"10"]
    redis_proxy.cut_after(b"EVALSHA", count=2)
    with pytest.raises(RedisConnectionError):
        await through_proxy.run([([key, log], [100])])
    assert redis_proxy.cuts_after_write == 3
    assert logged(fresh_redis, log) == [b"1", b"10", b"10", b"100", b"100"]
    assert await through_proxy.run([([key, log], [1000])]) == [1221]


async def test_close_lets_the_calls_under_way_finish(
    through_proxy: ScriptCoalescer, redis_proxy: TcpFaultProxy, fresh_redis: RedisServer
) -> None:
    log = f"log:{uuid.uuid4().hex}"
    _, call = await a_call_unanswered(through_proxy, redis_proxy, fresh_redis, log)
    closing = asyncio.create_task(through_proxy.close())
    await asyncio.wait([closing], timeout=0.2)
    assert not closing.done()
    redis_proxy.heal()
    assert await call == [3]
    await closing
    assert logged(fresh_redis, log) == [b"1", b"2"]  # answered on its first connection
