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
- **Failures.** A call's error goes to its own caller. A lost or stalled
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
from redis.exceptions import NoScriptError, ResponseError
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
        self._flushing: asyncio.Task[None] | None = None

    async def run(self, calls: Sequence[Call]) -> list[Any]:
        """Run ``calls`` in order, in the next write; their replies, or the
        error of the first call that failed."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._queue.append((calls, future))
        if self._flushing is None:
            # A task starts on the next loop turn: the calls issued in this one join it.
            self._flushing = asyncio.create_task(self._flush(), name="script-coalescer")
        return await future

    async def close(self) -> None:
        """Let the queued calls finish, then close the connection."""
        if self._flushing is not None:
            await asyncio.wait([self._flushing])
        if self._pipe is not None:
            await self._pipe.close()
            self._pipe = None

    async def _flush(self) -> None:
        batch: list[Queued] = []
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    replies = await self._replies([call for calls, _ in batch for call in calls])
                except Exception as exc:
                    _fail(batch, exc)
                    continue
                start = 0
                for calls, future in batch:
                    mine = replies[start : start + len(calls)]
                    start += len(calls)
                    if future.done():
                        continue  # its caller was cancelled; the calls ran all the same
                    error = next((r for r in mine if isinstance(r, Exception)), None)
                    if error is None:
                        future.set_result(mine)
                    else:
                        future.set_exception(error)
        except BaseException as exc:
            # Cancelled (the loop is closing): nobody may wait forever.
            _fail(batch + self._queue, RedisConnectionError(f"script calls abandoned: {exc!r}"))
            self._queue = []
            raise
        finally:
            self._flushing = None

    def _current(self) -> Pipe:
        pipe = self._pipe
        if pipe is None or pipe.dead:
            connection = self._pool.make_connection()  # type: ignore[no-untyped-call]
            pipe = self._pipe = Pipe(connection, "redis-scripts", self._stall_timeout)
            # Its reply matters to nobody: a load that failed shows as NOSCRIPT.
            (load,) = pipe.submit(("SCRIPT", "LOAD", self._script.source))
            load.add_done_callback(_retrieve)
        return pipe

    async def _replies(self, calls: Sequence[Call]) -> list[Any]:
        script = self._script
        replies: list[Any] = [None] * len(calls)
        unanswered = list(range(len(calls)))
        uncached: set[int] = set()
        losses = 0
        while unanswered:
            commands = []
            for index in unanswered:
                keys, args = calls[index]
                if index in uncached:
                    commands.append(("EVAL", script.source, len(keys), *keys, *args))
                else:
                    commands.append(("EVALSHA", script.sha, len(keys), *keys, *args))
            futures = self._current().submit(*commands)
            again: list[int] = []
            for position, (index, future) in enumerate(zip(unanswered, futures, strict=True)):
                try:
                    replies[index] = await future
                except NoScriptError:
                    # The cache was flushed under this connection: it did not run.
                    # EVAL runs it and loads the script again.
                    uncached.add(index)
                    again.append(index)
                except ResponseError as exc:
                    replies[index] = exc  # this call's own error
                except _LOST:
                    # Replies come in order: this one and every later one are lost.
                    for rest in futures[position + 1 :]:
                        _retrieve(rest)
                    losses += 1
                    if losses > RESENDS:
                        raise
                    again.extend(unanswered[position:])
                    break
            unanswered = again
        return replies


def _fail(batch: Sequence[Queued], exc: Exception) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark an outcome nobody awaits as seen (asyncio logs unseen exceptions)."""
    if not future.done():
        future.add_done_callback(_retrieve)
    elif not future.cancelled():
        future.exception()
