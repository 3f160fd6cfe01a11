"""The services' shared parts (leases, per-game locks, rate limits, claims) on memory and Redis.

For Redis, two instances on one server stand for two nodes; the memory parts are
one process's, so the same instance stands for both (leases: two over one table).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from loadtest.harness.redis_cluster import RedisCluster
from server.coordination import bot_sessions
from server.coordination.bot_sessions import (
    MARK_CHUNK,
    BotSessions,
    MemoryBotSessions,
    RedisBotSessions,
)
from server.coordination.claims import Claims, MemoryClaims, RedisClaims
from server.coordination.game_lock import (
    GameLocks,
    LockUnavailable,
    MemoryGameLocks,
    RedisGameLocks,
    lock_key,
)
from server.coordination.lease import Lease, LeaseState, LeaseTable, MemoryLease, RedisLease
from server.coordination.rate_limit import MemoryRateLimiter, RateLimiter, RedisRateLimiter
from server.redis.client import make_client, make_cluster_client
from tests.services import free_port, redis_url_for_tests


@pytest.fixture(scope="module")
def coordination_redis() -> Iterator[str]:
    with redis_url_for_tests() as url:
        yield url


def kinds() -> pytest.MarkDecorator:
    return pytest.mark.parametrize("kind", ["memory", "redis", "redis-cluster"])


def redis_for(kind: str, request: pytest.FixtureRequest) -> tuple[str, bool]:
    """The URL and whether it is a Redis Cluster (the session's shared one)."""
    if kind == "redis-cluster":
        cluster: RedisCluster = request.getfixturevalue("shared_redis_cluster")
        return cluster.url, True
    url: str = request.getfixturevalue("coordination_redis")
    return url, False


async def pair_of_locks(
    kind: str, request: pytest.FixtureRequest, wait: float
) -> tuple[GameLocks, GameLocks]:
    if kind == "memory":
        locks = MemoryGameLocks(wait=wait)
        return locks, locks
    url, sharded = redis_for(kind, request)
    return (
        RedisGameLocks(url, wait=wait, cluster=sharded),
        RedisGameLocks(url, wait=wait, cluster=sharded),
    )


@pytest.fixture
def game() -> str:
    return f"chess#{uuid.uuid4().hex[:8]}"


def leases(kind: str, request: pytest.FixtureRequest, lease_ms: int) -> tuple[Lease, Lease]:
    """Two candidates for one fresh lease key, as two nodes would be."""
    key = "ap:{lease-test:" + uuid.uuid4().hex[:8] + "}:leader"
    if kind == "memory":
        table = LeaseTable()
        return (
            MemoryLease(key, "first", lease_ms, table=table),
            MemoryLease(key, "second", lease_ms, table=table),
        )
    url, sharded = redis_for(kind, request)
    if sharded:
        return (
            RedisLease(make_cluster_client(url), key, "first", lease_ms, through_failover=True),
            RedisLease(make_cluster_client(url), key, "second", lease_ms, through_failover=True),
        )
    return (
        RedisLease(make_client(url), key, "first", lease_ms),
        RedisLease(make_client(url), key, "second", lease_ms),
    )


@kinds()
async def test_a_lease_has_one_holder_at_a_time(kind: str, request: pytest.FixtureRequest) -> None:
    first, second = leases(kind, request, lease_ms=30_000)
    assert await first.renew() is LeaseState.ACQUIRED
    assert await second.renew() is LeaseState.LOST
    assert await first.renew() is LeaseState.RENEWED
    assert first.valid_until > time.monotonic() and second.valid_until == 0.0
    # Compare-and-delete: a candidate that does not hold it cannot free it.
    await second.release()
    assert await second.renew() is LeaseState.LOST
    assert await first.renew() is LeaseState.RENEWED
    # The holder gives it up: the other takes over at once, and the first learns it.
    await first.release()
    assert first.valid_until == 0.0
    assert await second.renew() is LeaseState.ACQUIRED
    assert await first.renew() is LeaseState.LOST
    for lease in (first, second):
        await lease.close()


@kinds()
async def test_a_lapsed_lease_goes_to_the_next_asker_and_counts_as_new(
    kind: str, request: pytest.FixtureRequest
) -> None:
    first, second = leases(kind, request, lease_ms=200)
    assert await first.renew() is LeaseState.ACQUIRED
    await asyncio.sleep(0.4)  # twice the term: lapsed whatever the scheduler did
    assert time.monotonic() >= first.valid_until
    assert await second.renew() is LeaseState.ACQUIRED
    assert await first.renew() is LeaseState.LOST
    await asyncio.sleep(0.4)
    # Taken again by the one that held it before: new all the same, since
    # another may have held it in between (what must be reloaded, is).
    assert await second.renew() is LeaseState.ACQUIRED
    for lease in (first, second):
        await lease.close()


@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
async def test_a_redis_lease_key_holds_its_holders_token(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """What fencing compares with (the presence commit checks it in the same step)."""
    first, second = leases(kind, request, lease_ms=30_000)
    url, sharded = redis_for(kind, request)
    spy = make_cluster_client(url) if sharded else make_client(url)
    try:
        await first.renew()
        assert await spy.get(first.key) == first.token.encode()
        assert 0 < await spy.pttl(first.key) <= 30_000
        await first.release()
        assert await spy.exists(first.key) == 0
    finally:
        await spy.aclose()
        for lease in (first, second):
            await lease.close()


@kinds()
async def test_a_game_lock_is_exclusive_across_nodes(
    kind: str, request: pytest.FixtureRequest, game: str
) -> None:
    first, second = await pair_of_locks(kind, request, wait=20)
    inside = 0
    most = 0
    order: list[int] = []

    async def work(locks: GameLocks, n: int) -> None:
        nonlocal inside, most
        async with locks.hold(game) as held:
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.005)
            assert await held.confirm()
            order.append(n)
            inside -= 1

    await asyncio.gather(*(work(first if n % 2 else second, n) for n in range(30)))
    assert most == 1 and sorted(order) == list(range(30))
    # other games are not held up by this one
    async with first.hold(game), second.hold(game + "-other"):
        pass
    await first.close()
    await second.close()


@kinds()
async def test_a_busy_game_lock_times_out_and_is_freed_on_errors(
    kind: str, request: pytest.FixtureRequest, game: str
) -> None:
    first, second = await pair_of_locks(kind, request, wait=0.3)
    async with first.hold(game):
        with pytest.raises(LockUnavailable):
            async with second.hold(game):
                pass
    with pytest.raises(RuntimeError):
        async with first.hold(game):
            raise RuntimeError("boom")
    async with second.hold(game):  # released by the error
        pass
    await first.close()
    await second.close()


async def test_a_redis_lease_lost_behind_the_holders_back_is_reported(
    coordination_redis: str, game: str
) -> None:
    locks = RedisGameLocks(coordination_redis)
    spy = aioredis.Redis.from_url(coordination_redis)
    try:
        async with locks.hold(game) as held:
            assert await spy.exists(lock_key(game)) == 1
            await spy.delete(lock_key(game))  # as if the lease had run out
            assert not await held.confirm()
        assert await spy.exists(lock_key(game)) == 0
    finally:
        await spy.aclose()
        await locks.close()


async def pair_of_limiters(
    kind: str, request: pytest.FixtureRequest, limit: int, window: float
) -> tuple[RateLimiter, RateLimiter]:
    if kind == "memory":
        limiter = MemoryRateLimiter(limit, window)
        return limiter, limiter
    url, sharded = redis_for(kind, request)
    name = uuid.uuid4().hex[:6]
    return (
        RedisRateLimiter(url, name, limit, window, cluster=sharded),
        RedisRateLimiter(url, name, limit, window, cluster=sharded),
    )


@kinds()
async def test_the_rate_is_per_user_in_a_sliding_window(
    kind: str, request: pytest.FixtureRequest
) -> None:
    # A minute's window: the refusals hold however slowly these calls run.
    a, b = await pair_of_limiters(kind, request, limit=3, window=60.0)
    assert [await a.allow("u"), await b.allow("u"), await a.allow("u")] == [True] * 3
    assert not await b.allow("u") and not await a.allow("u")
    assert await b.allow("someone-else")
    await a.close()
    await b.close()
    # A second's window, full: once it has passed (a sleep is a lower bound), allowed again.
    a, b = await pair_of_limiters(kind, request, limit=3, window=1.0)
    for limiter in (a, b, a):
        await limiter.allow("u")
    await asyncio.sleep(1.1)
    assert await a.allow("u") and await b.allow("u")
    await a.close()
    await b.close()


@pytest.fixture
async def claims_pair(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[Claims, Claims]]:
    if request.param == "memory":
        claims = MemoryClaims()
        yield claims, claims
        return
    url, sharded = redis_for(request.param, request)
    purpose = uuid.uuid4().hex[:6]
    first = RedisClaims(url, purpose, cluster=sharded)
    second = RedisClaims(url, purpose, cluster=sharded)
    yield first, second
    await first.close()
    await second.close()


@pytest.mark.parametrize("claims_pair", ["memory", "redis", "redis-cluster"], indirect=True)
async def test_a_claim_goes_to_the_first_asker_until_it_expires(
    claims_pair: tuple[Claims, Claims],
) -> None:
    first, second = claims_pair
    # Held long enough for the checks however slow the machine is (a 0.5 s claim
    # lapsed between two calls at load 16)...
    assert await first.claim("alice", 30)
    assert not await second.claim("alice", 30) and not await first.claim("alice", 30)
    assert await second.claim("bob", 30)
    # ...and expiry shown with a short one: a sleep lasts at least as long as asked.
    assert await first.claim("carol", 0.2)
    await asyncio.sleep(0.3)
    assert await second.claim("carol", 0.2)


@pytest.mark.parametrize("claims_pair", ["memory", "redis", "redis-cluster"], indirect=True)
async def test_claims_in_one_call_follow_the_same_rule(
    claims_pair: tuple[Claims, Claims],
) -> None:
    first, second = claims_pair
    assert await first.claim("dave", 30)
    names = ["dave", *(f"user{index}" for index in range(40))]  # many slots on a cluster
    assert await second.claim_many(names, 30) == set(names[1:])
    assert await first.claim_many(names, 30) == set()
    assert await first.claim_many([], 30) == set()
    assert not await second.claim("user7", 30)


async def test_without_redis_locks_refuse_and_limits_fall_back_to_this_node() -> None:
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    locks = RedisGameLocks(nowhere, wait=1)
    with pytest.raises(LockUnavailable):
        async with locks.hold("chess#g1"):
            pass
    limiter = RedisRateLimiter(nowhere, "chat", 2, 10)
    assert [await limiter.allow("u") for _ in range(3)] == [True, True, False]
    claims = RedisClaims(nowhere, "last-seen")
    assert await claims.claim("u", 60) and not await claims.claim("u", 60)
    assert await claims.claim_many(["u", "v"], 60) == {"v"}
    for part in (locks, limiter, claims):
        await part.close()


def pair_of_bot_sessions(kind: str, request: pytest.FixtureRequest) -> list[BotSessions]:
    """Two nodes' marks on Redis; the memory one is a whole (one-node) cluster."""
    if kind == "memory":
        return [MemoryBotSessions("a")]
    url, sharded = redis_for(kind, request)
    return [RedisBotSessions(url, node, cluster=sharded) for node in ("a", "b")]


@kinds()
async def test_a_bot_marked_on_one_node_is_connected_for_every_node(
    kind: str, request: pytest.FixtureRequest
) -> None:
    nodes = pair_of_bot_sessions(kind, request)
    first, last = nodes[0], nodes[-1]
    bots = [f"bot-{uuid.uuid4().hex}" for _ in range(MARK_CHUNK + 3)]  # over one pipeline
    try:
        await first.mark(bots)
        for bot in (*bots[:3], *bots[-3:]):
            assert await last.connected(bot)
        assert not await last.connected(f"bot-{uuid.uuid4().hex}")
        await last.mark(bots[:1])
        await first.unmark(bots[0])
        # the other node's mark still stands; with one node, none is left
        assert await first.connected(bots[0]) is (len(nodes) == 2)
        await last.unmark(bots[0])
        assert not await first.connected(bots[0])
        assert await first.connected(bots[1])
    finally:
        for node in nodes:
            await node.close()


@kinds()
async def test_a_mark_not_renewed_lapses(
    kind: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes = pair_of_bot_sessions(kind, request)
    short, long = f"bot-{uuid.uuid4().hex}", f"bot-{uuid.uuid4().hex}"
    try:
        with monkeypatch.context() as patch:
            patch.setattr(bot_sessions, "MARK_SECONDS", 0.3)
            await nodes[0].mark([short])
        await nodes[0].mark([long])
        deadline = time.monotonic() + 10
        while await nodes[-1].connected(short):  # a killed node's marks go by themselves
            assert time.monotonic() < deadline, "the mark outlived its expiry by 10 s"
            await asyncio.sleep(0.05)
        assert await nodes[-1].connected(long)  # what lapsed was the short mark, by its expiry
    finally:
        for node in nodes:
            await node.close()
