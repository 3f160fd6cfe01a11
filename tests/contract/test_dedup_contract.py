"""The Dedup contract: one suite over the in-memory and the Redis implementation.

What every dedup promises (``server/dedup.py``): a free key is claimed once;
while claimed it is BUSY to other tokens and CLAIMED again to its holder;
``complete`` makes it DONE for the window; ``release`` frees only the holder's
claim; claims and done marks expire.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from server.bus.redis_bus import make_client
from server.dedup import Claim, Dedup, MemoryDedup, RedisDedup
from tests.services import redis_url_for_tests


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_url_for_tests() as url:
        yield url


@pytest.fixture(params=["memory", "redis"])
async def dedup(request: pytest.FixtureRequest) -> AsyncIterator[Dedup]:
    impl: Dedup
    if request.param == "memory":
        impl = MemoryDedup()
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
    keys = fresh(3)
    assert await dedup.claim(keys, "a", 10) == [Claim.CLAIMED] * 3
    assert await dedup.claim(keys, "b", 10) == [Claim.BUSY] * 3
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
