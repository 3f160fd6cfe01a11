"""The internal listener's connections: HTTP/1.1 with keep-alive, on asyncio.

Each request costs one read, one handler and one write; the parsing is
``protocol.http11``'s. A connection serves its requests one at a time and
answers them in order (pipelining); while its client does not read the answers
(the transport's write buffer is past its high-water mark), or while it has
sent far ahead of the request being served, it is not read. A connection that sits idle for
``KEEPALIVE_SECONDS``, or takes longer than ``REQUEST_SECONDS`` to send a
request it has begun, is closed by a sweep rather than a timer per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import cast

from protocol.http11 import CONTINUE, HttpError, Request, RequestParser, response
from server.ingress.routes import Reply, Routes
from server.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 75.0
"""What aiohttp, nginx and most load balancers keep an idle connection for."""
REQUEST_SECONDS = 30.0
"""From a request's first byte to its last: a slow sender is cut off."""
SWEEP_SECONDS = 5.0
LINGER_SECONDS = 2.0
"""After a refusal, what the client still sends is read and dropped this long: closed
with unread bytes, the socket would reset and the client might lose the answer."""
PAUSE_BUFFERED_BYTES = 256 * 1024
"""Pipelined bytes held while a request is being served, before reading pauses."""


class HttpConnection(asyncio.Protocol):
    __slots__ = (
        "active_at",
        "busy",
        "closing",
        "ended",
        "lingering",
        "listener",
        "parser",
        "reading_paused",
        "transport",
        "write_blocked",
    )

    def __init__(self, listener: HttpListener) -> None:
        self.listener = listener
        self.parser = RequestParser(listener.max_body)
        self.transport: asyncio.Transport | None = None
        self.busy: asyncio.Task[None] | None = None
        self.active_at = 0.0  # loop time of the last byte read, or of the last answer
        self.closing = False
        self.ended = False  # the client sent EOF: answer what it sent, then close
        self.lingering = False
        self.reading_paused = False
        self.write_blocked = False  # the client is not reading our answers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.active_at = self.listener.loop.time()
        self.listener.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.listener.connections.discard(self)
        # A handler still running finishes (a publish is not undone); its answer has nowhere to go.

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        self.active_at = self.listener.loop.time()
        self.parser.feed(data)
        if self.busy is None and not self.write_blocked:
            self._next()
        else:
            self._pace_reading()

    def eof_received(self) -> bool | None:
        self.ended = True
        if self.busy is None or self.lingering:
            self.close()
        return True  # a request being served still gets its answer, then the close

    # Past the transport's high-water mark the client is not reading what we send:
    # its next requests wait (and reading stops) until it does.

    def pause_writing(self) -> None:
        self.write_blocked = True
        self._pace_reading()

    def resume_writing(self) -> None:
        self.write_blocked = False
        if self.busy is None:
            self._next()

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _pace_reading(self) -> None:
        """Read while answers can leave and pipelined bytes stay few; else stop reading."""
        transport = self.transport
        if transport is None or self.lingering or transport.is_closing():
            return
        pause = self.write_blocked or (
            self.busy is not None and self.parser.buffered > PAUSE_BUFFERED_BYTES
        )
        if pause != self.reading_paused:
            self.reading_paused = pause
            if pause:
                transport.pause_reading()
            else:
                transport.resume_reading()

    def _linger(self) -> None:
        """Answered for the last time: send our end's EOF, then drop what still comes."""
        transport = self.transport
        assert transport is not None
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        self.closing = self.lingering = True
        if transport.can_write_eof():
            transport.write_eof()
        self.listener.loop.call_later(LINGER_SECONDS, transport.close)

    def _next(self) -> None:
        """Serve the requests that have arrived, in order, until one has to wait."""
        transport = self.transport
        assert transport is not None
        while not self.closing and self.busy is None and not self.write_blocked:
            try:
                request = self.parser.next_request()
            except HttpError as exc:
                reply = Reply.error(exc.status, exc.message)
                transport.write(
                    response(exc.status, reply.body, reply.content_type, keep_alive=False)
                )
                self._linger()
                return
            if request is None:
                if self.parser.take_continue():
                    transport.write(CONTINUE)
                break
            found = self.listener.routes.find(request.method, request.path)
            if isinstance(found, Reply):
                self._answer(request, found)
            else:
                self.busy = self.listener.loop.create_task(self._serve(request, found(request)))
        if self.ended and self.busy is None and not self.write_blocked:
            self.close()  # every request it sent before its EOF is answered
            return
        self._pace_reading()

    async def _serve(self, request: Request, reply: Awaitable[Reply]) -> None:
        try:
            answer = await reply
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            answer = Reply.error(500, "internal error")
        self.busy = None
        self._answer(request, answer)
        self._next()  # a pipelined request may be waiting

    def _answer(self, request: Request, reply: Reply) -> None:
        keep_alive = request.keep_alive and not self.listener.stopping
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(
            response(
                reply.status,
                reply.body,
                reply.content_type,
                keep_alive=keep_alive,
                head_only=request.method == "HEAD",
                headers=reply.headers,
            )
        )
        self.active_at = self.listener.loop.time()
        if not keep_alive:
            self._linger()


class HttpListener:
    """The server: its connections, their sweep, and a graceful stop."""

    def __init__(self, routes: Routes, max_body: int) -> None:
        self.routes = routes
        self.max_body = max_body
        self.loop = asyncio.get_running_loop()
        self.connections: set[HttpConnection] = set()
        self.stopping = False
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, backlog: int = 1024) -> None:
        self._server = await self.loop.create_server(
            lambda: HttpConnection(self), host, port, backlog=backlog, reuse_address=True
        )
        self._sweeper = asyncio.create_task(self._sweep(), name="http-sweep")

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            self.sweep(self.loop.time())

    def sweep(self, now: float) -> None:
        """Close connections idle past keep-alive, or stuck midway through a request."""
        for connection in list(self.connections):
            if connection.busy is not None:
                continue
            quiet = now - connection.active_at
            limit = REQUEST_SECONDS if connection.parser.midway else KEEPALIVE_SECONDS
            if quiet > limit:
                connection.close()

    async def stop(self, grace: float = 5.0) -> None:
        """Stop listening, close idle connections, and let requests in flight answer."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            await cancel_and_wait(self._sweeper)
        busy = [c.busy for c in self.connections if c.busy is not None]
        for connection in list(self.connections):
            if connection.busy is None:
                connection.close()
        if busy:
            await asyncio.wait(busy, timeout=grace)
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), grace)
