"""Group commit: per key, one write in flight; what queues meanwhile goes in the next one.

Chat stores a game's comments one writer at a time (the game's lock). Written
one by one, a busy game's comments wait for each other's round trips; here a
writer takes what is queued on its key as one batch, and whatever arrives while
that batch is being written forms the next. The writer takes its batch when it
is ready to write (for chat: once it holds the game's lock), so what queued
while it waited for the lock goes in too. Items keep their order: a key's
batches are written one after the other, each in the order it was queued.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

from server.runtime.tasks import cancel_all_and_wait

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")


class Turn(Generic[T]):
    """One writer's turn on a key: the queue, from which it takes its batch."""

    def __init__(self, queued: list[tuple[T, asyncio.Future[Any]]], max_batch: int) -> None:
        self._queued = queued
        self._max_batch = max_batch
        self.taken: list[tuple[T, asyncio.Future[Any]]] = []  # their answers

    @property
    def first(self) -> T:
        """The item this turn's batch starts with."""
        return self._queued[0][0]

    def take(self, ready: Callable[[T], bool] = lambda _: True) -> list[T]:
        """The batch, out of the queue: from the first item (taken whatever
        ``ready`` says), up to ``max_batch``, ending before the first item that is not
        ``ready`` (it and those after it wait for the next turn: order is kept)."""
        if self.taken:
            raise RuntimeError("a turn's batch is taken once")
        queued = self._queued
        end = 1
        while end < min(len(queued), self._max_batch) and ready(queued[end][0]):
            end += 1
        self.taken = queued[:end]
        del queued[:end]
        return [item for item, _ in self.taken]


WriteBatch = Callable[[K, Turn[T]], Awaitable[Sequence[R | Exception]]]
"""Writes one batch of a key: takes it from the turn (``Turn.take``) when ready to
write, and answers each item taken, in order (an exception refuses that item alone).
Raising refuses the batch (if nothing was taken yet: what ``take()`` would take)."""


class GroupClosed(Exception):
    """The group commit was closed before the item was written."""


class GroupCommit(Generic[K, T, R]):
    def __init__(self, name: str, write: WriteBatch[K, T, R], *, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._name = name
        self._write = write
        self._max_batch = max_batch
        self._queued: dict[K, list[tuple[T, asyncio.Future[R]]]] = {}
        self._writers: dict[K, asyncio.Task[None]] = {}
        self._closed = False

    @property
    def writing(self) -> int:
        """Keys with a writer running (for tests and gauges)."""
        return len(self._writers)

    def submit(self, key: K, item: T) -> asyncio.Future[R]:
        """Queue ``item`` on ``key``; its answer. Queued now, in call order, and
        written once whatever becomes of the future (a cancelled waiter included)."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        if self._closed:
            _refuse([(item, future)], GroupClosed(f"{self._name} is closed"))
            return future
        self._queued.setdefault(key, []).append((item, future))
        if key not in self._writers:
            self._writers[key] = asyncio.create_task(self._drain(key), name=f"{self._name}:{key}")
        return future

    async def close(self, grace: float = 0.0) -> None:
        """Take no more items; give the writers up to ``grace`` seconds to write what
        is queued, then stop them: whatever they had not answered is refused with
        GroupClosed."""
        self._closed = True
        writers = list(self._writers.values())
        if writers and grace > 0:
            await asyncio.wait(writers, timeout=grace)
        await cancel_all_and_wait(list(self._writers.values()))
        for queued in self._queued.values():
            _refuse(queued, GroupClosed(f"{self._name} closed"))
        self._queued.clear()

    async def _drain(self, key: K) -> None:
        turn: Turn[T] | None = None
        try:
            while queued := self._queued.get(key):
                turn = Turn(queued, self._max_batch)
                try:
                    answers = await self._write(key, turn)
                    if not turn.taken:
                        raise RuntimeError(f"{self._name}: a write took nothing")
                except Exception as exc:
                    if not turn.taken:
                        turn.take()  # what waited for this write fails with it
                    _refuse(turn.taken, exc)
                else:
                    for (_, future), answer in zip(turn.taken, answers, strict=True):
                        if isinstance(answer, Exception):
                            _refuse([(None, future)], answer)
                        elif not future.done():  # done: its waiter was cancelled
                            future.set_result(answer)
                turn = None
        finally:
            # Cancelled mid-batch (close): the batch's waiters hear of it.
            if turn is not None:
                _refuse(turn.taken, GroupClosed(f"{self._name} closed"))
            if not self._queued.get(key, True):
                del self._queued[key]
            del self._writers[key]


def _refuse(batch: Sequence[tuple[object, asyncio.Future[R]]], exc: Exception) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)
            # Marked as retrieved: a future whose holder has stopped waiting is
            # not a lost error for asyncio to log.
            with contextlib.suppress(BaseException):
                future.exception()
