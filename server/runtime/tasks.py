"""Small helpers for the node's own asyncio tasks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from typing import Any


async def cancel_and_wait(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and return once it has finished (its cancellation swallowed)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def run_until_unwound(stack: AsyncExitStack, coro: Coroutine[Any, Any, None], name: str) -> None:
    """Run ``coro`` as a task until ``stack`` unwinds, which cancels it and waits for it."""
    task = asyncio.create_task(coro, name=name)
    stack.push_async_callback(cancel_and_wait, task)
