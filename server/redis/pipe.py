"""One Redis connection, pipelined: each loop turn's commands in one write.

Every command submitted in one event-loop turn goes out in one write, whether
or not earlier writes are answered; one reader task hands the replies back in
order (Redis answers a connection's commands in the order it received them).
So commands on one pipe also *run* in the order they were submitted. An owner
that wants fewer, fuller writes holds its commands back itself (the coalescer
keeps one write in flight).

Nothing here retries: a lost connection, or one that leaves its oldest command
unanswered for ``stall_timeout``, fails every command outstanding on it and
marks the pipe dead. Its owner opens a new pipe and decides what to resend
(:mod:`server.redis.shard_pipes` for a Redis Cluster, :mod:`server.redis.coalesce`
for one Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from typing import Any

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from server.runtime.tasks import cancel_and_wait

STALL_TIMEOUT_S = 5.0
"""A connection with commands outstanding and no reply for this long is dead."""


class Pipe:
    """Batched writes on one connection, replies matched to commands in order."""

    def __init__(
        self, connection: AbstractConnection, name: str, stall_timeout: float = STALL_TIMEOUT_S
    ) -> None:
        self.name = name
        self.stall_timeout = stall_timeout
        self.connection = connection
        self.dead = False
        self._out: list[bytes] = []
        self._waiting: deque[tuple[float, asyncio.Future[Any]]] = deque()  # (queued at, reply)
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"pipe-{name}")

    def submit(self, *commands: tuple[Any, ...]) -> list[asyncio.Future[Any]]:
        """Queue ``commands`` back to back; one future per command, in order."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        futures = []
        for args in commands:
            future: asyncio.Future[Any] = loop.create_future()
            if self.dead:
                future.set_exception(RedisConnectionError(f"connection to {self.name} lost"))
            else:
                self._out.extend(self.connection.pack_command(*args))
                self._waiting.append((now, future))
            futures.append(future)
        self._wake.set()
        return futures

    async def _run(self) -> None:
        reader: asyncio.Task[None] | None = None
        # From the start: a frozen server accepts the TCP connection and then
        # never answers the handshake.
        watchdog = asyncio.create_task(self._watch(), name=f"pipe-watch-{self.name}")
        try:
            await self.connection.connect()  # type: ignore[no-untyped-call]
            reader = asyncio.create_task(self._read(), name=f"pipe-read-{self.name}")
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._out:
                    batch, self._out = self._out, []
                    await self.connection.send_packed_command(batch, check_health=False)
        except asyncio.CancelledError:
            self._fail(RedisConnectionError(f"connection to {self.name} closed"))
            raise
        except Exception as exc:
            self._fail(exc)
        finally:
            watchdog.cancel()
            if reader is not None:
                reader.cancel()
            with contextlib.suppress(Exception):
                await self.connection.disconnect(nowait=True)

    async def _read(self) -> None:
        try:
            while True:
                try:
                    reply: Any = await self.connection.read_response(timeout=math.inf)
                except ResponseError as exc:
                    reply = exc
                _, future = self._waiting.popleft()
                if future.done():
                    continue
                if isinstance(reply, ResponseError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)
            self._task.cancel()

    async def _watch(self) -> None:
        """Replies come in order: the oldest command unanswered for the whole
        timeout means nothing was answered since; the connection is dead."""
        loop = asyncio.get_running_loop()
        timeout = self.stall_timeout
        while True:
            await asyncio.sleep(timeout / 5)
            if self._waiting and loop.time() - self._waiting[0][0] > timeout:
                self._fail(RedisTimeoutError(f"no reply from {self.name} in {timeout:g}s"))
                self._task.cancel()
                return

    def _fail(self, exc: BaseException) -> None:
        if not isinstance(exc, RedisError | OSError):
            exc = RedisConnectionError(f"connection to {self.name} failed: {exc!r}")
        self.dead = True
        self._out.clear()
        while self._waiting:
            _, future = self._waiting.popleft()
            if not future.done():
                future.set_exception(exc)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await cancel_and_wait(self._task)
