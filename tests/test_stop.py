"""A node always finishes stopping: every task it cancels ends, even one whose
cancellation a library dropped.

On Python 3.11 ``asyncio.wait_for`` returns its inner result when the caller is
cancelled in the loop turn the inner awaitable completes in (CPython gh-86296).
redis-py wraps each command's socket write in one, so a task cancelled while it
runs a Redis command sometimes carries on as if never cancelled. A node's
write-behind flusher then went back to waiting for work, and ``stop`` waited for
it forever: "shutting down" in the log, then nothing, until a kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest

from server.redis.client import make_client
from server.runtime.metrics import Registry
from server.runtime.tasks import cancel_all_and_wait, cancel_and_wait
from server.runtime.write_behind import CoalescingFlusher
from tests.services import RedisServer

DEADLINE = 60.0
"""A hang guard: each stop here takes milliseconds when it works."""


async def swallows_one_cancellation(wakeup: asyncio.Event) -> None:
    """What a loop around a redis-py call does when the call dropped a cancellation."""
    with contextlib.suppress(asyncio.CancelledError):  # dropped: the loop goes on
        await asyncio.sleep(3600)
    await wakeup.wait()


async def test_a_task_that_drops_its_cancellation_is_cancelled_again() -> None:
    task = asyncio.create_task(swallows_one_cancellation(asyncio.Event()))
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, recancel=0.1), DEADLINE)
    assert task.cancelled()


async def test_every_task_of_a_group_ends_even_if_some_drop_a_cancellation() -> None:
    wakeup = asyncio.Event()
    tasks = [asyncio.create_task(swallows_one_cancellation(wakeup)) for _ in range(3)]
    tasks.append(asyncio.create_task(asyncio.sleep(3600)))
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_all_and_wait([*tasks, None], recancel=0.1), DEADLINE)
    assert all(task.cancelled() for task in tasks)


@pytest.mark.timeout(120)  # before the fix, the close never returned: this fails it
async def test_a_flusher_writing_to_redis_always_closes(fresh_redis: RedisServer) -> None:
    """The hang itself: a flusher closed while it runs Redis commands, many times
    (about one close in ten met a dropped cancellation before the fix)."""
    client = make_client(fresh_redis.url)
    counter = itertools.count()
    current: list[CoalescingFlusher[str, int]] = []

    async def write(batch: dict[str, int]) -> dict[str, int]:
        await client.mset(batch)
        current[-1].put(f"k{next(counter) % 8}", 1)  # always more to write
        return {}

    try:
        for round_ in range(40):
            flusher = CoalescingFlusher("test", write, max, Registry().counter("f", "f"))
            current.append(flusher)
            flusher.start()
            flusher.put("k0", round_)
            await asyncio.sleep(0.001 * (round_ % 7))
            task = flusher._task
            assert task is not None
            await asyncio.wait_for(flusher.close(), DEADLINE)
            assert task.done(), f"round {round_}: the flusher still runs after close"
    finally:
        await client.aclose()
