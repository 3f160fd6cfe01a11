"""Script calls of concurrent callers, one pipeline per round trip, on a real Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from server.bus.redis_streams import RedisStreams
from server.redis.coalesce import ScriptCoalescer
from tests.services import redis_url_for_tests

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


async def test_one_callers_error_fails_that_caller_only(client: aioredis.Redis) -> None:
    coalescer = ScriptCoalescer(client, INCR_BY)
    key, log = f"n:{uuid.uuid4().hex}", f"log:{uuid.uuid4().hex}"
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
    await coalescer.close()


async def test_calls_run_again_after_the_script_cache_was_flushed(
    client: aioredis.Redis,
) -> None:
    coalescer = ScriptCoalescer(client, INCR_BY)
    key, log = f"n:{uuid.uuid4().hex}", f"log:{uuid.uuid4().hex}"
    assert await coalescer.run([([key, log], [5])]) == [5]
    await client.script_flush()
    # NOSCRIPT: none of these ran, so each runs once after SCRIPT LOAD.
    assert await coalescer.run([([key, log], [1]), ([key, log], [1])]) == [6, 7]
    await client.script_flush()
    assert await coalescer.run([([key, log], [3])]) == [10]  # alone: a plain EVALSHA
    assert await client.lrange(log, 0, -1) == [b"5", b"1", b"1", b"3"]
    await coalescer.close()
