"""Subscriptions that callers wait for, in batches: one bus round trip for many.

Before a recovery reads any history, its session's streams must be heard on
the bus (``Recovery.recover``). In a reconnect storm that is thousands of
``Bus.subscribe`` calls, each a ``SUBSCRIBE`` and a confirming round trip on
Redis. Here the topics asked for while a subscribe is out are gathered and go
out as the next single ``subscribe``; every caller returns once the bus has
taken a call that named all of its topics, as if it had called it itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from server.bus.base import Bus
from server.runtime.tasks import cancel_and_wait


class SubscribeBatcher:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._topics: set[str] = set()
        self._next: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def subscribe(self, topics: Iterable[str]) -> None:
        """Return once the bus has taken the subscription to ``topics`` (or raise its error)."""
        self._topics.update(topics)
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            self._next.add_done_callback(_retrieve)
            if self._task is None:
                # At the end of this loop turn: callers of the same turn share the call.
                asyncio.get_running_loop().call_soon(self._start)
        # Shielded: one caller going away must not cancel the call for the others.
        await asyncio.shield(self._next)

    def _start(self) -> None:
        if self._task is None and self._next is not None:
            self._task = asyncio.create_task(self._run(), name="bus-subscribe")

    async def _run(self) -> None:
        try:
            while self._next is not None:
                future, topics = self._next, sorted(self._topics)
                self._next, self._topics = None, set()
                try:
                    await self._bus.subscribe(topics)
                except asyncio.CancelledError:
                    future.cancel()
                    raise
                except Exception as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(None)
        finally:
            self._task = None

    async def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None
        if self._task is not None:
            await cancel_and_wait(self._task)


def _retrieve(future: asyncio.Future[None]) -> None:
    """Every caller may have gone: the error is not worth a "never retrieved" log."""
    if not future.cancelled():
        future.exception()
