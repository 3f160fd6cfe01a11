"""Chat authorization's kept ``GAME`` rows (``server/services/game_access.py``): an
active game is read once and shared, a kept row is never used past ``stale``, and an
ended game is refused as soon as a read sees it. Time is a clock the test moves."""

from __future__ import annotations

import asyncio

import pytest

from server.runtime.metrics import Registry
from server.services.game_access import MAX_GAMES, GameAccessCache
from server.store.base import StoreUnavailable
from server.store.memory import MemoryStore
from server.store.records import GameAccess, GameStatus
from tests.chat_helpers import complete_game, seed_game
from tests.clock import Clock
from tests.rows import Rows

GAME = ("chess", "g1")


class Reads:
    """The store's own read, counted, and held while ``gate`` is clear."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.count = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.failing = False

    async def __call__(self, meta: str, game_id: str) -> GameAccess:
        self.count += 1
        await self.gate.wait()
        if self.failing:
            raise StoreUnavailable("the table is unreachable")
        return await self.store.get_game_access(meta, game_id)


@pytest.fixture
def store() -> MemoryStore:
    store = MemoryStore()
    seed_game(Rows(store), GAME, ["alice", "bob"])
    return store


def cache_of(reads: Reads, clock: Clock, size: int = MAX_GAMES) -> GameAccessCache:
    return GameAccessCache(reads, fresh=1.0, stale=5.0, size=size, clock=clock)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_concurrent_comments_share_one_read_and_the_next_ones_none(
    store: MemoryStore,
) -> None:
    reads, clock = Reads(store), Clock()
    metrics = Registry()
    cache = GameAccessCache(reads, clock=clock, metrics=metrics)
    reads.gate.clear()
    waiting = [asyncio.create_task(cache.get(*GAME)) for _ in range(5)]
    await settle()
    assert reads.count == 1 and not any(task.done() for task in waiting)
    reads.gate.set()
    answers = await asyncio.gather(*waiting)
    assert answers == [GameAccess(GameStatus.ACTIVE, ("alice", "bob"))] * 5
    clock.now += 0.9
    assert (await cache.get(*GAME)).players == ("alice", "bob")
    await settle()
    assert reads.count == 1
    assert metrics.value("ap_chat_access_reads_total") == 1
    assert metrics.value("ap_chat_access_cached_total") == 1


async def test_an_ended_game_is_refused_once_a_read_behind_a_comment_sees_it(
    store: MemoryStore,
) -> None:
    reads, clock = Reads(store), Clock()
    cache = cache_of(reads, clock)
    assert (await cache.get(*GAME)).status is GameStatus.ACTIVE
    complete_game(Rows(store), GAME)
    clock.now += 2.0  # past fresh: answered from the kept row, read behind it
    reads.gate.clear()
    first = await cache.get(*GAME)
    second = await cache.get(*GAME)  # the same read, not a second one
    assert first.status is second.status is GameStatus.ACTIVE
    await settle()
    assert reads.count == 2
    reads.gate.set()
    await settle()
    assert len(cache) == 0  # an ended game is not kept
    assert (await cache.get(*GAME)).status is GameStatus.COMPLETED
    assert (await cache.get(*GAME)).status is GameStatus.COMPLETED
    assert reads.count == 4  # each comment on it reads


async def test_a_kept_row_is_never_used_past_stale(store: MemoryStore) -> None:
    reads, clock = Reads(store), Clock()
    cache = cache_of(reads, clock)
    await cache.get(*GAME)
    complete_game(Rows(store), GAME)
    clock.now += 5.0  # a read begun 5 s ago: too old to judge on
    assert (await cache.get(*GAME)).status is GameStatus.COMPLETED
    assert reads.count == 2


async def test_a_row_read_again_ages_from_when_its_read_began(store: MemoryStore) -> None:
    reads, clock = Reads(store), Clock()
    cache = cache_of(reads, clock)
    await cache.get(*GAME)
    clock.now += 4.5
    reads.gate.clear()
    await cache.get(*GAME)  # behind it, a read that takes 3 s
    await settle()
    clock.now += 3.0
    reads.gate.set()
    await settle()
    # 3 s old by its start, not 0 by its end: fresh is past, so read behind again.
    clock.now += 0.5
    await cache.get(*GAME)
    await settle()
    assert reads.count == 3


async def test_unknown_and_completed_games_are_read_for_every_comment(
    store: MemoryStore,
) -> None:
    seed_game(Rows(store), ("chess", "done"), ["alice"], completed=True)
    reads, clock = Reads(store), Clock()
    cache = cache_of(reads, clock)
    for _ in range(2):
        assert (await cache.get("chess", "done")).status is GameStatus.COMPLETED
        assert (await cache.get("chess", "nope")).status is GameStatus.MISSING
    assert reads.count == 4
    # A game created after a comment found nothing is found by the next one.
    seed_game(Rows(store), ("chess", "nope"), ["carol"])
    assert (await cache.get("chess", "nope")).players == ("carol",)


async def test_a_failed_read_reaches_its_comment_and_a_failed_read_behind_does_not(
    store: MemoryStore,
) -> None:
    reads, clock = Reads(store), Clock()
    cache = cache_of(reads, clock)
    reads.failing = True
    with pytest.raises(StoreUnavailable):
        await cache.get(*GAME)
    reads.failing = False
    await cache.get(*GAME)
    reads.failing = True
    clock.now += 2.0
    assert (await cache.get(*GAME)).status is GameStatus.ACTIVE  # kept, read behind fails
    await settle()
    assert len(cache) == 1
    clock.now += 3.0  # the kept read is now 5 s old
    with pytest.raises(StoreUnavailable):
        await cache.get(*GAME)
    assert reads.count == 4


async def test_at_most_size_games_are_kept_the_least_recently_read_dropped(
    store: MemoryStore,
) -> None:
    for number in range(3):
        seed_game(Rows(store), ("chess", f"x{number}"), ["alice"])
    reads, clock = Reads(store), Clock()
    cache = cache_of(reads, clock, size=2)
    for number in range(3):
        await cache.get("chess", f"x{number}")
    assert len(cache) == 2
    await cache.get("chess", "x2")
    await cache.get("chess", "x1")
    assert reads.count == 3
    await cache.get("chess", "x0")  # dropped: read again
    assert reads.count == 4


async def test_a_caller_that_gives_up_leaves_the_shared_read_to_the_others(
    store: MemoryStore,
) -> None:
    reads, clock = Reads(store), Clock()
    cache = cache_of(reads, clock)
    reads.gate.clear()
    leaving = asyncio.create_task(cache.get(*GAME))
    staying = asyncio.create_task(cache.get(*GAME))
    await settle()
    leaving.cancel()
    await settle()
    reads.gate.set()
    assert (await staying).status is GameStatus.ACTIVE
    assert reads.count == 1


async def test_close_cancels_the_reads_under_way(store: MemoryStore) -> None:
    reads, clock = Reads(store), Clock()
    cache = cache_of(reads, clock)
    reads.gate.clear()
    waiting = asyncio.create_task(cache.get(*GAME))
    await settle()
    await cache.close()
    with pytest.raises(asyncio.CancelledError):
        await waiting


def test_fresh_past_stale_is_refused() -> None:
    with pytest.raises(ValueError, match="fresh <= stale"):
        GameAccessCache(MemoryStore().get_game_access, fresh=6.0, stale=5.0)
