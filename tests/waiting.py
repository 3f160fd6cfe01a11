"""Waiting for what a test cannot await directly: a condition that comes true on its own.

The bound is a hang guard for a shared, loaded machine, never the thing measured:
a test that checks a promised time checks it by cause, not by a stopwatch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    check: Callable[[], object], within: float, what: str = "condition", *, every: float = 0.05
) -> None:
    """Return once ``check()`` is true; ``AssertionError`` after ``within`` seconds."""

    async def ask() -> object:
        return check()

    await _poll(ask, within, what, every)


async def eventually_read(
    read: Callable[[], Awaitable[T]],
    check: Callable[[T], object],
    within: float,
    what: str = "condition",
    *,
    every: float = 0.2,
) -> None:
    """``eventually`` for a value that must be awaited: until ``check(await read())``."""

    async def ask() -> object:
        return check(await read())

    await _poll(ask, within, what, every)


async def eventually_in_thread(check: Callable[[], object], within: float, what: str) -> None:
    """``eventually`` for a check that blocks (a boto3 call): each try runs in a thread,
    so the servers on this loop keep running meanwhile."""
    await _poll(lambda: asyncio.to_thread(check), within, what, 0.1)


async def _poll(
    ask: Callable[[], Awaitable[object]], within: float, what: str, every: float
) -> None:
    deadline = time.monotonic() + within
    while not await ask():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g}s waiting for {what}")
        await asyncio.sleep(every)
