"""One Lua script's calls, from many callers at once, as one write per round trip.

Concurrent ``POST /publish`` requests each append one event. Sent one by one,
each is an ``EVALSHA`` of its own: a socket write, a read and a reply parse per
event, which capped a node well below what Redis takes. A
:class:`ScriptCoalescer` queues the calls issued while a write is being
answered (or within one loop turn) and sends them all in the next write, on a
connection of its own (:class:`~server.redis.pipe.Pipe`; redis-py's pipeline
object and pool cost more CPU per call than the calls do).

- **Order.** One write in flight at a time, on one connection: calls reach
  Redis in the order they were issued on this node, a caller's calls stay
  contiguous, and per-stream order holds.
- **Atomicity.** Each call is still one script run; a pipeline is not a
  transaction, nor does it need to be.
- **The script.** Each new connection starts with ``SCRIPT LOAD``, so a Redis
  that restarted (its connections dropped) knows the script before the first
  ``EVALSHA`` on the new one. ``NOSCRIPT`` then means the cache was flushed
  under a live connection: none of those calls ran, and they are sent again as
  ``EVAL``.
- **Failures.** A call's error goes to its own caller, and so does an argument
  Redis cannot take (nothing of that write is sent; the other callers' calls go
  in the next one, in their order). A lost or stalled
  connection fails what was outstanding on it; the unanswered calls are sent
  once more, in order, on a new connection. Some may have run already: every
  append names its event, so a resent one runs once
  (``server/bus/redis_streams.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from server.redis.pipe import STALL_TIMEOUT_S, Pipe
from server.redis.scripts import Script

Call = tuple[Sequence[str], Sequence[Any]]
"""One script run: (keys, args)."""
Queued = tuple[Sequence[Call], "asyncio.Future[list[Any]]"]
"""One caller's calls and where their replies go."""

_LOST = (RedisConnectionError, RedisTimeoutError, OSError)
RESENDS = 1
"""How often a call is sent again after its connection was lost."""


class ScriptCoalescer:
    def __init__(
        self, client: aioredis.Redis, script: str, *, stall_timeout: float = STALL_TIMEOUT_S
    ) -> None:
        # The command client's pool knows the URL (TLS, credentials, database,
        # client name); the pipe's connection is made the same way, outside the pool.
        self._pool = client.connection_pool
        self._script = Script(script)
        self._stall_timeout = stall_timeout
        self._pipe: Pipe | None = None
        self._queue: list[Queued] = []
        self._in_flight: _Batch | None = None
        self._send_soon: asyncio.Handle | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    async def run(self, calls: Sequence[Call]) -> list[Any]:
        """Run ``calls`` in order, in the next write; their replies, or the
        error of the first call that failed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self._queue.append((calls, future))
        self._idle.clear()
        if self._in_flight is None and self._send_soon is None:
            # Sent at the end of this loop turn: the calls issued in it join.
            self._send_soon = loop.call_soon(self._send_queued)
        return await future

    async def close(self) -> None:
        """Let the queued calls finish, then close the connection."""
        await self._idle.wait()
        if self._pipe is not None:
            await self._pipe.close()
            self._pipe = None

    def _send_queued(self) -> None:
        """Send the queue as one batch. Called when nothing is in flight, from
        ``call_soon`` or from the reply that ended the batch before, so the next
        write leaves in the same loop turn as the last reply arrived."""
        self._send_soon = None
        if not self._queue:
            self._idle.set()
            return
        callers, self._queue = self._queue, []
        batch = self._in_flight = _Batch(callers)
        self._send(batch)

    def _send(self, batch: _Batch) -> None:
        script = self._script
        commands = []
        for index in batch.unanswered:
            keys, args = batch.calls[index]
            commands.append(script.command(keys, args, cached=index not in batch.uncached))
        batch.outcomes = []
        expected = len(commands)

        def collect(outcome: Any) -> None:
            batch.outcomes.append(outcome)
            if len(batch.outcomes) == expected:
                self._answered(batch)

        try:
            self._current().send(commands, [collect] * expected, now=True)
        except DataError as exc:
            # An argument Redis cannot take (the callers' input is checked long
            # before): nothing was sent. Its caller fails, and only its caller.
            self._drop_unsendable(batch, exc)

    def _drop_unsendable(self, batch: _Batch, error: DataError) -> None:
        """Fail the callers with a call that cannot be sent, each with its own
        error; the others go again, first in the queue and in their order."""
        if batch.losses or batch.uncached:
            # A resend: it packed before, and some of its calls may have run.
            return self._done(batch, error)
        pipe = self._current()
        sendable: list[Queued] = []
        for calls, future in batch.callers:
            try:
                for keys, args in calls:
                    pipe.check(self._script.command(keys, args))
            except DataError as exc:
                _fail([(calls, future)], exc)
            else:
                sendable.append((calls, future))
        if len(sendable) == len(batch.callers):
            return self._done(batch, error)  # no caller to blame: never loop
        self._in_flight = None
        self._queue[:0] = sendable
        self._send_queued()

    def _answered(self, batch: _Batch) -> None:
        """Every command of the batch's last write has its outcome."""
        again: list[int] = []
        for position, (index, outcome) in enumerate(
            zip(batch.unanswered, batch.outcomes, strict=True)
        ):
            if isinstance(outcome, NoScriptError):
                # The cache was flushed under this connection: it did not run.
                # EVAL runs it and loads the script again.
                batch.uncached.add(index)
                again.append(index)
            elif isinstance(outcome, ResponseError):
                batch.replies[index] = outcome  # this call's own error
            elif isinstance(outcome, _LOST):
                # Replies come in order: this one and every later one are lost.
                batch.losses += 1
                if batch.losses > RESENDS:
                    return self._done(batch, outcome)
                again.extend(batch.unanswered[position:])
                break
            elif isinstance(outcome, BaseException):
                return self._done(batch, outcome)
            else:
                batch.replies[index] = outcome
        if again:
            batch.unanswered = again
            self._send(batch)
        else:
            self._done(batch, None)

    def _done(self, batch: _Batch, error: BaseException | None) -> None:
        self._in_flight = None
        if error is not None:
            _fail(batch.callers, error)
        else:
            start = 0
            for calls, future in batch.callers:
                mine = batch.replies[start : start + len(calls)]
                start += len(calls)
                if future.done():
                    continue  # its caller was cancelled; the calls ran all the same
                failed = next((r for r in mine if isinstance(r, BaseException)), None)
                if failed is None:
                    future.set_result(mine)
                else:
                    future.set_exception(failed)
        self._send_queued()

    def _current(self) -> Pipe:
        pipe = self._pipe
        if pipe is None or pipe.dead:
            connection = self._pool.make_connection()  # type: ignore[no-untyped-call]
            pipe = self._pipe = Pipe(connection, "redis-scripts", self._stall_timeout)
            # Its reply matters to nobody: a load that failed shows as NOSCRIPT.
            pipe.send([("SCRIPT", "LOAD", self._script.source)], [_ignore])
        return pipe


class _Batch:
    """One write's callers, and where their calls stand."""

    def __init__(self, callers: list[Queued]) -> None:
        self.callers = callers
        self.calls: list[Call] = [call for calls, _ in callers for call in calls]
        self.replies: list[Any] = [None] * len(self.calls)
        self.unanswered = list(range(len(self.calls)))
        self.uncached: set[int] = set()
        self.outcomes: list[Any] = []
        self.losses = 0


def _fail(batch: Sequence[Queued], exc: BaseException) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)


def _ignore(outcome: Any) -> None:
    pass
