"""A write-behind buffer that coalesces updates per key and flushes in batches.

Used wherever many small writes per second must not become many round trips:
connection rows to the store, presence reports to the cluster. A failed batch
is merged back under any newer value for the same key and retried with
jittered backoff, so nothing is lost while the backend is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from server.runtime.backoff import Backoff
from server.runtime.metrics import Counter
from server.runtime.tasks import cancel_and_wait

K = TypeVar("K")
V = TypeVar("V")

log = logging.getLogger(__name__)

FlushFn = Callable[[dict[K, V]], Awaitable[dict[K, V]]]
"""Writes a batch; returns the entries that failed and must be retried."""


class CoalescingFlusher(Generic[K, V]):
    def __init__(
        self,
        name: str,
        flush: FlushFn[K, V],
        merge: Callable[[V, V], V],
        failures: Counter,
        *,
        max_backoff: float = 5.0,
    ) -> None:
        self._name = name
        self._flush = flush
        self._merge = merge
        self._failures = failures
        self._max_backoff = max_backoff
        self._pending: dict[K, V] = {}
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        self._closing = False
        self._task = asyncio.create_task(self._run(), name=f"flusher:{self._name}")

    async def close(self) -> None:
        # The flag as well as the cancellation: a write that drops its cancellation
        # (see cancel_and_wait) would otherwise go on to the next batch, and the next.
        self._closing = True
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    def put(self, key: K, value: V) -> None:
        """Queue a value; it is merged over any pending value for the same key."""
        # Membership, not ``get() is None``: None is a value here (a presence leave).
        pending = self._pending
        pending[key] = self._merge(pending[key], value) if key in pending else value
        self._idle.clear()
        self._wakeup.set()

    @property
    def backlog(self) -> int:
        return len(self._pending)

    async def drained(self) -> None:
        """Wait until everything queued so far has been written."""
        await self._idle.wait()

    async def _run(self) -> None:
        retrying = Backoff(first=0.1, cap=self._max_backoff).start()
        while not self._closing:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending and not self._closing:
                batch, self._pending = self._pending, {}
                try:
                    failed = await self._flush(batch)
                except Exception as exc:  # the backend's errors vary; all are retried
                    log.warning("%s: batch of %d failed: %s", self._name, len(batch), exc)
                    failed = batch
                if failed:
                    log.warning("%s: %d writes failed, retrying", self._name, len(failed))
                    self._failures.inc(len(failed))
                    pending = self._pending
                    for key, value in failed.items():
                        # A value queued meanwhile is newer than the failed one.
                        pending[key] = self._merge(value, pending[key]) if key in pending else value
                    await retrying.wait()
                else:
                    retrying.reset()
            self._idle.set()


class WriteBehind(Generic[K, V]):
    """A service whose writes all go through one flusher: its life is the flusher's."""

    _flusher: CoalescingFlusher[K, V]

    def start(self) -> None:
        self._flusher.start()

    async def close(self) -> None:
        await self._flusher.close()

    async def drained(self) -> None:
        """Wait until everything queued so far has been written."""
        await self._flusher.drained()


class Drains(Protocol):
    async def drained(self) -> None: ...


async def drained_within(seconds: float, *pending: Drains) -> None:
    """Give each write-behind up to ``seconds`` to send what it holds, then go on."""
    for part in pending:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(part.drained(), seconds)
