"""One Lua script's calls, from many callers at once, pipelined on one connection.

Concurrent ``POST /publish`` requests each append one event. Sent one by one,
each is an ``EVALSHA`` of its own: a socket write, a read and a reply parse per
event, which capped a node well below what Redis takes. A
:class:`ScriptCoalescer` sends every call issued in one loop turn in one write
on its own :class:`~server.redis.pipe.Pipe`, without waiting for the previous
write's replies: a publish waits for its own round trip only.

- **Order.** One connection, and Redis runs a connection's commands in the
  order it received them: calls reach Redis in the order they were issued on
  this node, a caller's calls stay contiguous, and per-stream order holds.
- **Atomicity.** Each call is still one script run; a pipeline is not a
  transaction, nor does it need to be.
- **The script.** Each new connection starts with ``SCRIPT LOAD``, so a Redis
  that restarted (its connections dropped) knows the script before the first
  ``EVALSHA`` on the new one. ``NOSCRIPT`` then means the cache was flushed
  under a live connection: none of those calls ran, and they are sent again as
  ``EVAL``.
- **Failures.** A call's error goes to its own caller. A lost or stalled
  connection fails what was outstanding on it; each caller resends its
  unanswered calls once, in order, on a new connection. Some may have run
  already: every append names its event, so a resent one runs once
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
from server.redis.shard_pipes import Script

Call = tuple[Sequence[str], Sequence[Any]]
"""One script run: (keys, args)."""

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
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def run(self, calls: Sequence[Call]) -> list[Any]:
        """Run ``calls`` in order, in the next write; their replies, or the
        first call's error that failed."""
        self._running += 1
        self._idle.clear()
        try:
            replies = await self._replies(calls)
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if error is not None:
            raise error
        return replies

    async def close(self) -> None:
        """Let the calls under way finish, then close the connection."""
        await self._idle.wait()
        if self._pipe is not None:
            await self._pipe.close()
            self._pipe = None

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


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark an outcome nobody awaits as seen (asyncio logs unseen exceptions)."""
    if not future.done():
        future.add_done_callback(_retrieve)
    elif not future.cancelled():
        future.exception()
