"""One Redis connection, pipelined: each loop turn's commands in one write.

Every command submitted in one event-loop turn goes out in one write, whether
or not earlier writes are answered (an owner may ask for a write at once
instead). Redis answers a connection's commands in the order it received
them, so commands on one pipe also *run* in the order they were submitted.

Replies are parsed where they arrive. redis-py makes the connection (TLS,
``AUTH``, ``SELECT``, the client name); then the pipe's own protocol takes its
transport, hiredis parses whatever each read holds, and each reply goes to its
command's sink in that same callback. A reply read by a task, handed to the
awaiting coalescer, handed to its caller, cost three loop turns, each behind
whatever else the loop had queued (a fan-out flush of milliseconds, under
load); here it costs none, and a :class:`~asyncio.Future` sink costs one.

Nothing here retries: a lost connection, or one that leaves its oldest command
unanswered for ``stall_timeout``, fails every command outstanding on it and
marks the pipe dead. Its owner opens a new pipe and decides what to resend
(:mod:`server.redis.shard_pipes` for a Redis Cluster, :mod:`server.redis.coalesce`
for one Redis).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import hiredis
from redis._parsers import BaseParser
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, InvalidResponse, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from server.runtime.tasks import cancel_and_wait

STALL_TIMEOUT_S = 5.0
"""A connection with commands outstanding and no reply for this long is dead."""

Sink = Callable[[Any], None]
"""Takes one command's outcome: its reply, a ``ResponseError`` Redis answered
(``NoScriptError``, ``MovedError`` and the rest, as redis-py names them), or the
error that lost the connection. Called in the loop turn the reply is read."""

_PENDING = object()
"""hiredis's "no whole reply yet" (its default, ``False``, is a RESP3 reply)."""


class Pipe:
    """Batched writes on one connection, replies matched to commands in order."""

    def __init__(
        self, connection: AbstractConnection, name: str, stall_timeout: float = STALL_TIMEOUT_S
    ) -> None:
        self.name = name
        self.stall_timeout = stall_timeout
        self.connection = connection
        self.dead = False
        self._loop = asyncio.get_running_loop()
        self._out: list[bytes] = []
        self._waiting: deque[tuple[float, Sink]] = deque()  # (queued at, sink)
        self._transport: asyncio.Transport | None = None
        self._write_soon: asyncio.Handle | None = None
        self._parser = _reader_for(connection)
        self._pack = _packer_for(connection)
        self._ended: asyncio.Future[None] = self._loop.create_future()
        self._task = asyncio.create_task(self._run(), name=f"pipe-{name}")

    def submit(self, *commands: tuple[Any, ...]) -> list[asyncio.Future[Any]]:
        """Queue ``commands`` back to back; one future per command, in order."""
        futures: list[asyncio.Future[Any]] = [self._loop.create_future() for _ in commands]
        self.send(commands, [_settler(future) for future in futures])
        return futures

    def check(self, command: tuple[Any, ...]) -> None:
        """Raise the ``DataError`` that :meth:`send` would for ``command``."""
        self._pack(command)

    def send(
        self, commands: Sequence[tuple[Any, ...]], sinks: Sequence[Sink], *, now: bool = False
    ) -> None:
        """Queue ``commands`` back to back, each outcome to its sink.

        Written at the end of this loop turn with every other command submitted
        in it, or at once with ``now`` (for an owner that batched them itself).
        On a dead pipe every sink is called before this returns. An argument
        Redis cannot take raises ``DataError``, and nothing is queued."""
        if self.dead:
            error = RedisConnectionError(f"connection to {self.name} lost")
            for sink in sinks:
                sink(error)
            return
        if len(commands) != len(sinks):
            raise ValueError(f"{len(commands)} commands for {len(sinks)} sinks")
        pack = self._pack
        packed = [pack(args) for args in commands]
        queued_at = self._loop.time()
        self._out.extend(packed)
        self._waiting.extend([(queued_at, sink) for sink in sinks])
        if self._transport is None:
            return  # written once connected
        if now:
            self._write()
        elif self._write_soon is None:
            self._write_soon = self._loop.call_soon(self._write)

    def _write(self) -> None:
        self._write_soon = None
        if self._out and self._transport is not None:
            data = b"".join(self._out)
            self._out = []
            self._transport.write(data)

    async def _run(self) -> None:
        # From the start: a frozen server accepts the TCP connection and then
        # never answers the handshake.
        watchdog = asyncio.create_task(self._watch(), name=f"pipe-watch-{self.name}")
        try:
            await self.connection.connect()  # type: ignore[no-untyped-call]
            self._take_transport()
            self._write()
            await self._ended
        except asyncio.CancelledError:
            self._fail(RedisConnectionError(f"connection to {self.name} closed"))
            raise
        except Exception as exc:
            self._fail(exc)
        finally:
            watchdog.cancel()
            with contextlib.suppress(Exception):
                await self.connection.disconnect(nowait=True)

    def _take_transport(self) -> None:
        # redis-py keeps its streams private; tests/test_pipe.py pins them.
        reader, writer = self.connection._reader, self.connection._writer
        if reader is None or writer is None:
            raise RedisConnectionError(f"the connection to {self.name} has no stream")
        # asyncio's or uvloop's: both hand a transport to a new protocol.
        transport = cast(asyncio.Transport, writer.transport)
        transport.set_protocol(_Replies(self))
        leftover: bytearray = reader._buffer  # type: ignore[attr-defined]
        if leftover:  # what the handshake's reads left over
            self._received(bytes(leftover))
        if reader.at_eof() or transport.is_closing():
            # Closed before the protocol was ours: nothing will tell it.
            raise RedisConnectionError(f"{self.name} closed the connection at its handshake")
        self._transport = transport

    def _received(self, data: bytes) -> None:
        parser = self._parser
        waiting = self._waiting
        parser.feed(data)
        try:
            while (reply := parser.gets()) is not _PENDING:
                if not waiting:
                    raise InvalidResponse(f"a reply from {self.name} nobody asked for")
                waiting.popleft()[1](reply)
        except (RedisError, hiredis.ProtocolError) as exc:
            self._fail(exc)

    async def _watch(self) -> None:
        """Replies come in order: the oldest command unanswered for the whole
        timeout means nothing was answered since; the connection is dead."""
        timeout = self.stall_timeout
        while True:
            await asyncio.sleep(timeout / 5)
            if self._waiting and self._loop.time() - self._waiting[0][0] > timeout:
                self._fail(RedisTimeoutError(f"no reply from {self.name} in {timeout:g}s"))
                self._task.cancel()  # it may be stuck in the handshake
                return

    def _fail(self, exc: BaseException) -> None:
        if not isinstance(exc, RedisError):  # as redis-py names a socket's errors
            lost = RedisConnectionError(f"connection to {self.name} failed: {exc!r}")
            lost.__cause__ = exc
            exc = lost
        self.dead = True
        self._out.clear()
        if self._write_soon is not None:
            self._write_soon.cancel()
            self._write_soon = None
        waiting = self._waiting
        while waiting:
            waiting.popleft()[1](exc)
        if not self._ended.done():
            self._ended.set_result(None)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await cancel_and_wait(self._task)


class _Replies(asyncio.Protocol):
    """The pipe's side of its transport, once redis-py's handshake is done."""

    def __init__(self, pipe: Pipe) -> None:
        self._pipe = pipe

    def data_received(self, data: bytes) -> None:
        self._pipe._received(data)

    def eof_received(self) -> bool:
        self._pipe._fail(RedisConnectionError(f"{self._pipe.name} closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._pipe._fail(exc or RedisConnectionError(f"connection to {self._pipe.name} lost"))


def _reader_for(connection: AbstractConnection) -> hiredis.Reader:
    """A parser that decodes, and names errors, as the connection's own would."""
    encoder = connection.encoder
    decoding = encoder.decode_responses
    return hiredis.Reader(
        protocolError=InvalidResponse,
        replyError=BaseParser.parse_error,
        notEnoughData=_PENDING,
        encoding=encoder.encoding if decoding else None,
        errors=encoder.encoding_errors if decoding else None,
    )


def _packer_for(connection: AbstractConnection) -> Callable[[tuple[Any, ...]], bytes]:
    """One command's bytes, as the connection's own ``pack_command`` makes them.

    hiredis's C packer where it encodes as the connection does (UTF-8, strict):
    redis-py's packer runs a Python call per argument first, about a third of
    an append's CPU. Every argument is one bulk string (bytes, str, int,
    float); a bool, ``None`` or a string that does not encode is a ``DataError``.
    """
    encoder = connection.encoder
    if codecs.lookup(encoder.encoding).name == "utf-8" and encoder.encoding_errors == "strict":
        return _pack_utf8
    pack_command = connection.pack_command

    def pack(args: tuple[Any, ...]) -> bytes:
        return b"".join(pack_command(*args))

    return pack


def _pack_utf8(args: tuple[Any, ...]) -> bytes:
    try:
        return cast(bytes, hiredis.pack_command(args))
    except (TypeError, UnicodeError) as exc:
        raise DataError(f"cannot send {str(args[0])!r} to Redis: {exc}") from exc


def _settler(future: asyncio.Future[Any]) -> Sink:
    def settle(outcome: Any) -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    return settle
