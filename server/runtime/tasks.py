"""Small helpers for the node's own asyncio tasks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterable
from contextlib import AsyncExitStack
from typing import Any, TextIO

RECANCEL_SECONDS = 5.0
"""How long a cancelled task has to finish before it is cancelled again: long
enough for the cleanup a cancellation starts (closing clients), which a second
cancellation would cut short."""


async def cancel_and_wait(task: asyncio.Future[Any], recancel: float = RECANCEL_SECONDS) -> None:
    """Cancel ``task`` and return once it has finished (its cancellation swallowed).

    Cancelled again until it finishes: on Python 3.11, ``asyncio.wait_for`` drops a
    cancellation that arrives in the loop turn its inner awaitable completes in
    (CPython gh-86296), and redis-py wraps every command's socket write in one, so a
    task cancelled mid-command can carry on as if nothing happened: a loop around
    such a call goes back to waiting for work, and a plain ``await task`` waits for
    it forever (a node that never finished stopping)."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=recancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def cancel_all_and_wait(
    tasks: Iterable[asyncio.Future[Any] | None], recancel: float = RECANCEL_SECONDS
) -> None:
    """:func:`cancel_and_wait` for every task at once (``None`` entries skipped)."""
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    await asyncio.gather(*(cancel_and_wait(task, recancel) for task in running))


def run_until_unwound(stack: AsyncExitStack, coro: Coroutine[Any, Any, None], name: str) -> None:
    """Run ``coro`` as a task until ``stack`` unwinds, which cancels it and waits for it."""
    task = asyncio.create_task(coro, name=name)
    stack.push_async_callback(cancel_and_wait, task)


def dump_tasks(out: TextIO) -> None:
    """Write every task of the running loop with its stack (``kill -USR1`` on a node):
    what a process that will not stop is waiting for."""
    tasks = asyncio.all_tasks()
    print(f"--- {len(tasks)} asyncio tasks ---", file=out)
    for task in sorted(tasks, key=lambda t: t.get_name()):
        print(f"task {task.get_name()}: {task!r}", file=out)
        task.print_stack(limit=20, file=out)
    print("--- end of tasks ---", file=out, flush=True)
