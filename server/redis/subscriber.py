"""One pub/sub connection, read in bulk: the buses' subscriber side.

redis-py's ``PubSub.get_message`` costs a task wake-up, a timeout scope and a
dict per message; on a node that mostly fans events out, that was a quarter of
its CPU. Here one read takes whatever the socket holds, hiredis parses every
reply in it, and each message goes to the bus's callback on the spot.

redis-py still makes the connection (TLS, ``AUTH``, ``SELECT`` and the client
name, from the same URL and options as every other client); after its
handshake the connection's stream is read and written here only. Nothing
reconnects by itself: a failure ends :meth:`Subscriber.run`, and the bus starts
over on a fresh connection, knowing it may have missed messages.

Messages are *held* until :meth:`Subscriber.release`: a bus first subscribes
and confirms (:meth:`Subscriber.barrier`), runs its reconnect callbacks, and
only then delivers what the new connection received.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from server.runtime.tasks import cancel_and_wait

Push = list[Any]
"""A server push as hiredis gives it, a list under RESP2 or RESP3:
``[b"message", channel, data]``, ``[b"subscribe", channel, count]``,
``[b"smessage", ...]`` and so on."""

READ_SIZE = 1 << 16
CONFIRM_TIMEOUT_S = 5.0
"""How long Redis has to answer a barrier (the ``PING`` after subscriptions)."""


class Subscriber:
    """A subscribed connection: commands out, pushes to ``on_push``, pongs to barriers."""

    def __init__(
        self,
        connection: AbstractConnection,
        on_push: Callable[[Push], None],
        *,
        keepalive: float,
        name: str = "redis",
    ) -> None:
        self.connection = connection
        self.name = name
        self._on_push = on_push
        self._keepalive = keepalive
        self._held: list[Push] | None = []
        self._barriers: dict[bytes, asyncio.Future[None]] = {}
        self._parser = hiredis.Reader()
        self._stream: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lost: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.last_seen = 0.0

    async def open(self) -> None:
        """Connect (redis-py's handshake) and start reading."""
        await self.connection.connect()  # type: ignore[no-untyped-call]
        # redis-py keeps the streams private; tests/cluster/test_subscriber.py pins them.
        self._stream = self.connection._reader
        self._writer = self.connection._writer
        if self._stream is None or self._writer is None:
            raise RedisConnectionError("the Redis connection has no stream after connecting")
        self._lost = asyncio.get_running_loop().create_future()
        self.last_seen = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._read(), name=f"subscriber-read-{self.name}"),
            asyncio.create_task(self._watch(), name=f"subscriber-watch-{self.name}"),
        ]

    def send(self, *commands: Iterable[Any]) -> None:
        """Write ``commands`` in one go (their replies arrive as pushes)."""
        writer = self._writer
        if writer is None or writer.is_closing() or self.failed:
            raise RedisConnectionError("the subscriber connection is closed")
        writer.writelines(self.connection.pack_commands(commands))

    async def barrier(self) -> None:
        """Return once Redis has handled every command sent so far.

        ``TimeoutError`` if it does not answer within ``CONFIRM_TIMEOUT_S``; the
        connection's error if it fails meanwhile."""
        token = uuid.uuid4().hex.encode()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers[token] = future
        try:
            self.send(("PING", token))
            await asyncio.wait_for(future, CONFIRM_TIMEOUT_S)
        finally:
            self._barriers.pop(token, None)

    def release(self) -> None:
        """Deliver what arrived so far, then every push as it arrives."""
        held, self._held = self._held, None
        if held:
            for push in held:
                self._on_push(push)

    @property
    def failed(self) -> bool:
        return self._lost is not None and self._lost.done()

    async def run(self) -> None:
        """Wait until the connection fails, and raise why."""
        if self._lost is None:
            raise RedisConnectionError("the subscriber was never opened")
        await asyncio.shield(self._lost)

    def drop(self, reason: str) -> None:
        """End the connection as lost (``run`` raises), though it looks healthy: for
        a subscription found silent by a check of what Redis committed."""
        self._fail(RedisConnectionError(reason))

    async def close(self) -> None:
        self._fail(RedisConnectionError("the subscriber connection was closed"))
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                await cancel_and_wait(task)
        with contextlib.suppress(Exception):
            await self.connection.disconnect(nowait=True)

    # --- reading ------------------------------------------------------------

    async def _read(self) -> None:
        assert self._stream is not None
        read = self._stream.read
        feed = self._parser.feed
        gets = self._parser.gets
        try:
            while True:
                data = await read(READ_SIZE)
                if not data:
                    raise RedisConnectionError("Redis closed the subscriber connection")
                self.last_seen = time.monotonic()
                feed(data)
                while (reply := gets()) is not False:
                    self._reply(reply)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)

    def _reply(self, reply: Any) -> None:
        # A list: a RESP2 array, or RESP3's push (hiredis.PushNotification).
        if isinstance(reply, list):
            if reply[0] == b"pong":
                self._pong(reply[1])
            elif self._held is None:
                self._on_push(reply)
            else:
                self._held.append(reply)
        elif isinstance(reply, hiredis.ReplyError):
            raise ResponseError(str(reply))
        elif type(reply) is bytes:
            self._pong(reply)  # PING under RESP3, or with no subscription: a plain reply

    def _pong(self, token: bytes) -> None:
        future = self._barriers.get(token)
        if future is not None and not future.done():
            future.set_result(None)

    async def _watch(self) -> None:
        """Ping a quiet connection; one that stays silent twice as long is dead."""
        keepalive = self._keepalive
        try:
            while True:
                slept_from = time.monotonic()
                await asyncio.sleep(keepalive / 2)
                now = time.monotonic()
                if now - slept_from > keepalive:
                    continue  # this process was stalled, not Redis: the reader goes first
                quiet = now - self.last_seen
                if quiet > 2 * keepalive:
                    raise TimeoutError(f"no answer from Redis in {quiet:.1f}s")
                if quiet >= keepalive:
                    self.send(("PING",))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        lost = self._lost
        if lost is None or lost.done():
            return
        lost.set_exception(exc)
        lost.exception()  # retrieved: a closed subscriber nobody awaits is not an error
        for future in self._barriers.values():
            if not future.done():
                future.set_exception(RedisConnectionError(f"subscriber connection lost: {exc}"))
                future.exception()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if self._writer is not None:
            self._writer.close()
