"""The Dedup contract: one suite over every implementation.

What every dedup promises (``server/coordination/dedup.py``), in memory, on one Redis and on
the session's Redis Cluster (keys of one call spread over its slots and primaries):
a free key is claimed once;
while claimed it is BUSY to other tokens and CLAIMED again to its holder;
``complete`` makes it DONE for the window; ``release`` frees only the holder's
claim; claims and done marks expire.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from loadtest.harness.redis_cluster import RedisCluster
from server.coordination.dedup import Claim, Dedup, MemoryDedup, RedisClusterDedup, RedisDedup
from server.redis.client import make_client, make_cluster_client
from tests.services import redis_url_for_tests


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_url_for_tests() as url:
        yield url


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def dedup(request: pytest.FixtureRequest) -> AsyncIterator[Dedup]:
    impl: Dedup
    if request.param == "memory":
        impl = MemoryDedup()
    elif request.param == "redis-cluster":
        cluster: RedisCluster = request.getfixturevalue("shared_redis_cluster")
        impl = RedisClusterDedup(make_cluster_client(cluster.url))
    else:
        impl = RedisDedup(make_client(request.getfixturevalue("redis_url")))
    try:
        yield impl
    finally:
        await impl.close()


def fresh(count: int = 1) -> list[str]:
    prefix = f"ap:test:{uuid.uuid4().hex}:"
    return [f"{prefix}{n}" for n in range(count)]


async def test_a_free_key_is_claimed_once(dedup: Dedup) -> None:
    keys = fresh(12)  # on a Redis Cluster: slots of every primary, most likely
    assert await dedup.claim(keys, "a", 10) == [Claim.CLAIMED] * 12
    assert await dedup.claim(keys, "b", 10) == [Claim.BUSY] * 12
    assert await dedup.claim(keys[:1], "a", 10) == [Claim.CLAIMED]  # the holder again


async def test_complete_makes_keys_done_for_everyone(dedup: Dedup) -> None:
    keys = fresh(2)
    await dedup.claim(keys, "a", 10)
    await dedup.complete(keys[:1], 10)
    assert await dedup.claim(keys, "b", 10) == [Claim.DONE, Claim.BUSY]
    assert await dedup.claim(keys[:1], "a", 10) == [Claim.DONE]


async def test_release_frees_only_the_holders_claim(dedup: Dedup) -> None:
    first, second = fresh(2)
    await dedup.claim([first], "a", 10)
    await dedup.release([first], "b")  # not b's: no effect
    assert await dedup.claim([first], "b", 10) == [Claim.BUSY]
    await dedup.release([first], "a")
    assert await dedup.claim([first], "b", 10) == [Claim.CLAIMED]
    await dedup.complete([second], 10)
    await dedup.release([second], "a")  # a done mark is nobody's claim
    assert await dedup.claim([second], "b", 10) == [Claim.DONE]


async def test_claims_and_done_marks_expire(dedup: Dedup) -> None:
    claimed, done = fresh(2)
    await dedup.claim([claimed], "a", 0.2)
    await dedup.complete([done], 0.2)
    await asyncio.sleep(0.4)
    assert await dedup.claim([claimed, done], "b", 10) == [Claim.CLAIMED, Claim.CLAIMED]


async def test_empty_calls_do_nothing(dedup: Dedup) -> None:
    assert await dedup.claim([], "a", 10) == []
    await dedup.complete([], 10)
    await dedup.release([], "a")


async def test_two_tokens_claiming_at_once_never_both_win(dedup: Dedup) -> None:
    keys = fresh(10)
    first, second = await asyncio.gather(dedup.claim(keys, "a", 10), dedup.claim(keys, "b", 10))
    assert all({a, b} == {Claim.CLAIMED, Claim.BUSY} for a, b in zip(first, second, strict=True))


async def test_a_cluster_claim_that_fails_part_way_frees_what_it_claimed(
    shared_redis_cluster: RedisCluster,
) -> None:
    """One key of the batch cannot be claimed (it holds a list): the call fails, and the
    keys it did claim on other slots are free again, not BUSY until the claim expires."""
    client = make_cluster_client(shared_redis_cluster.url)
    dedup = RedisClusterDedup(client, failover_seconds=0.3)
    try:
        keys = fresh(6)
        await client.rpush(keys[3], "not a dedup mark")
        with pytest.raises(Exception, match="WRONGTYPE"):
            await dedup.claim(keys, "a", 10)
        others = keys[:3] + keys[4:]
        assert await dedup.claim(others, "b", 10) == [Claim.CLAIMED] * 5
    finally:
        await dedup.close()
