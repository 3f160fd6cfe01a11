"""One Lua script's calls, from many callers at once, as one pipelined round trip.

Concurrent ``POST /publish`` requests each append one event. Sent one by one,
each is an ``EVALSHA`` of its own: a socket write, a read and a reply parse per
event, which capped a node well below what Redis takes. A
:class:`ScriptCoalescer` queues the calls issued while a round trip is under way
(or within one loop turn) and sends them all in the next pipeline.

- **Order.** One pipeline is in flight at a time and Redis runs a pipeline's
  commands in order, so calls reach Redis in the order they were issued on this
  node: a caller's batch stays contiguous, and per-stream order holds.
- **Atomicity.** Each call is still one script run; a pipeline is not a
  transaction, nor does it need to be.
- **Failures.** A call's error goes to its own caller; a lost connection fails
  every call of that pipeline (some may have run: every append names its
  event, so one resent, here or by redis-py's retry, runs once). ``NOSCRIPT``
  means the script did not run, so those calls are sent again after
  ``SCRIPT LOAD``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

Call = tuple[Sequence[str], Sequence[Any]]
"""One script run: (keys, args)."""
Queued = tuple[Sequence[Call], "asyncio.Future[list[Any]]"]
"""One caller's calls and where their replies go."""


class ScriptCoalescer:
    def __init__(self, client: Any, script: str) -> None:
        self._client = client
        self._script = script
        self._sha = hashlib.sha1(script.encode()).hexdigest()
        self._queue: list[Queued] = []
        self._flushing: asyncio.Task[None] | None = None

    async def run(self, calls: Sequence[Call]) -> list[Any]:
        """Run ``calls`` in order, in the next pipeline; their replies."""
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._queue.append((calls, future))
        if self._flushing is None:
            # A task starts on the next loop turn: the calls issued in this one join it.
            self._flushing = asyncio.create_task(self._flush(), name="script-coalescer")
        return await future

    async def close(self) -> None:
        """Let the queued calls finish."""
        if self._flushing is not None:
            await asyncio.wait([self._flushing])

    async def _flush(self) -> None:
        batch: list[Queued] = []
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    replies = await self._send([call for calls, _ in batch for call in calls])
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
            _fail(batch + self._queue, ConnectionError(f"script calls abandoned: {exc!r}"))
            self._queue = []
            raise
        finally:
            self._flushing = None

    async def _send(self, calls: list[Call]) -> list[Any]:
        if len(calls) == 1:
            # Alone in its turn (a quiet node): a plain EVALSHA costs less CPU than a pipeline.
            return [await self._single(*calls[0])]
        replies = await self._pipeline(calls)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            # Redis restarted or its script cache was flushed: none of these ran.
            await self._client.script_load(self._script)
            again = await self._pipeline([calls[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def _single(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            try:
                return await self._client.evalsha(self._sha, len(keys), *keys, *args)
            except NoScriptError:
                await self._client.script_load(self._script)
                return await self._client.evalsha(self._sha, len(keys), *keys, *args)
        except ResponseError as exc:
            return exc  # this call's own error, as a pipeline would return it

    async def _pipeline(self, calls: list[Call]) -> list[Any]:
        # ``async with``: a pipeline that failed gives its connection back to the pool.
        async with self._client.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.evalsha(self._sha, len(keys), *keys, *args)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies


def _fail(batch: Sequence[Queued], exc: Exception) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)
