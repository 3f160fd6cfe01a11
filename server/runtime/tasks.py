"""Small helpers for the node's own asyncio tasks."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and return once it has finished (its cancellation swallowed)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
