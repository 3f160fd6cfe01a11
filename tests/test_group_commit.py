"""Group commit: one batch in flight per key; what queues meanwhile is the next batch."""

from __future__ import annotations

import asyncio

import pytest

from server.runtime.group_commit import GroupClosed, GroupCommit, Turn


class Writes:
    """A write that records its batches and, when asked, holds each until released
    (having taken its batch first, or, with ``take_late``, after the release)."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, list[int]]] = []
        self.hold = False
        self.take_late = False
        self.ready: set[int] | None = None  # None: every item is ready
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    def _take(self, turn: Turn[int]) -> list[int]:
        ready = self.ready
        return turn.take() if ready is None else turn.take(lambda item: item in ready)

    async def __call__(self, key: str, turn: Turn[int]) -> list[int | Exception]:
        items = [] if self.take_late else self._take(turn)
        self.started.set()
        if self.hold:
            await self.release.wait()
        if self.take_late:
            items = self._take(turn)
        self.batches.append((key, items))
        if any(item < 0 for item in items):
            raise RuntimeError("the whole batch failed")
        return [ValueError(f"odd {item}") if item % 2 else item * 10 for item in items]


async def test_items_queued_during_a_write_go_together_in_the_next_in_order() -> None:
    writes = Writes()
    writes.hold = True
    group: GroupCommit[str, int, int] = GroupCommit("t", writes, max_batch=10)
    first = group.submit("g", 0)
    await writes.started.wait()  # the first batch is in flight
    rest = [group.submit("g", item) for item in (2, 4, 6)]
    other_game = group.submit("h", 8)
    writes.release.set()
    assert await first == 0
    assert await asyncio.gather(*rest) == [20, 40, 60]
    assert await other_game == 80
    assert sorted(writes.batches) == [("g", [0]), ("g", [2, 4, 6]), ("h", [8])]
    assert group.writing == 0  # the writers stop when their queue is empty
    await group.close()


async def test_each_item_gets_its_own_answer_and_a_failed_batch_refuses_all_of_it() -> None:
    writes = Writes()
    writes.hold = True
    group: GroupCommit[str, int, int] = GroupCommit("t", writes, max_batch=10)
    blocker = group.submit("g", 0)
    await writes.started.wait()
    mixed = [group.submit("g", item) for item in (2, 3)]
    writes.release.set()
    await blocker
    assert await mixed[0] == 20
    with pytest.raises(ValueError, match="odd 3"):
        await mixed[1]
    writes.hold = False
    failing = [group.submit("g", item) for item in (4, -1)]
    for future in failing:
        with pytest.raises(RuntimeError, match="whole batch"):
            await future
    assert await group.submit("g", 6) == 60  # the next batch goes on
    await group.close()


async def test_a_batch_holds_at_most_max_batch_items() -> None:
    writes = Writes()
    writes.hold = True
    group: GroupCommit[str, int, int] = GroupCommit("t", writes, max_batch=3)
    futures = [group.submit("g", 2 * item) for item in range(8)]
    writes.release.set()
    assert await asyncio.gather(*futures) == [20 * item for item in range(8)]
    assert [len(items) for _, items in writes.batches] == [3, 3, 2]
    assert [i for _, items in writes.batches for i in items] == [2 * i for i in range(8)]
    await group.close()


async def test_a_cancelled_waiter_does_not_unqueue_its_item() -> None:
    writes = Writes()
    writes.hold = True
    group: GroupCommit[str, int, int] = GroupCommit("t", writes, max_batch=10)
    first = group.submit("g", 0)
    await writes.started.wait()
    abandoned = group.submit("g", 2)
    abandoned.cancel()
    kept = group.submit("g", 4)
    writes.release.set()
    await first
    assert await kept == 40
    assert writes.batches == [("g", [0]), ("g", [2, 4])]  # written all the same
    await group.close()


async def test_close_refuses_the_batch_in_flight_what_is_queued_and_what_comes_after() -> None:
    writes = Writes()
    writes.hold = True
    group: GroupCommit[str, int, int] = GroupCommit("t", writes, max_batch=10)
    in_flight = group.submit("g", 0)
    await writes.started.wait()
    queued = group.submit("g", 2)
    await group.close()
    for future in (in_flight, queued, group.submit("g", 4)):
        with pytest.raises(GroupClosed):
            await future
    assert group.writing == 0


async def test_a_writer_that_takes_its_batch_late_gets_what_queued_while_it_waited() -> None:
    writes = Writes()
    writes.hold = writes.take_late = True
    group: GroupCommit[str, int, int] = GroupCommit("t", writes, max_batch=10)
    futures = [group.submit("g", 0)]
    await writes.started.wait()  # waiting (for its lock), nothing taken yet
    futures += [group.submit("g", item) for item in (2, 4)]
    writes.release.set()
    assert await asyncio.gather(*futures) == [0, 20, 40]
    assert writes.batches == [("g", [0, 2, 4])]
    await group.close()


async def test_an_item_not_ready_ends_the_batch_and_keeps_its_place() -> None:
    writes = Writes()
    writes.hold = writes.take_late = True
    writes.ready = {0, 2, 6}  # 4 is not: it and what follows wait for the next turn
    group: GroupCommit[str, int, int] = GroupCommit("t", writes, max_batch=10)
    futures = [group.submit("g", item) for item in (0, 2, 4, 6)]
    writes.release.set()
    assert await asyncio.gather(*futures) == [0, 20, 40, 60]
    # the first item of a turn is taken whether ready or not
    assert writes.batches == [("g", [0, 2]), ("g", [4, 6])]
    await group.close()


async def test_a_failed_write_that_took_nothing_refuses_what_waited_for_it() -> None:
    async def no_lock(key: str, turn: Turn[int]) -> list[int | Exception]:
        await asyncio.sleep(0)
        raise TimeoutError("the lock was not free")

    group: GroupCommit[str, int, int] = GroupCommit("t", no_lock, max_batch=2)
    futures = [group.submit("g", item) for item in range(3)]
    for future in futures:
        with pytest.raises(TimeoutError):
            await future
    await group.close()


async def test_close_with_grace_writes_what_was_queued_and_refuses_what_comes_after() -> None:
    writes = Writes()
    writes.hold = True
    group: GroupCommit[str, int, int] = GroupCommit("t", writes, max_batch=10)
    in_flight = group.submit("g", 0)
    await writes.started.wait()
    queued = group.submit("g", 2)
    closing = asyncio.create_task(group.close(grace=30))
    await asyncio.sleep(0)
    with pytest.raises(GroupClosed):
        await group.submit("g", 4)
    writes.release.set()
    await closing
    assert (await in_flight, await queued) == (0, 20)
    assert writes.batches == [("g", [0]), ("g", [2])]


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        GroupCommit("t", Writes(), max_batch=0)
