"""The internal listener's connections: HTTP/1.1 with keep-alive, on asyncio.

Each request costs one read, one handler and one write; the parsing is
``protocol.http11``'s. A connection serves its requests one at a time and
answers them in order (pipelining). A connection that sits idle for
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
        "lingering",
        "listener",
        "parser",
        "paused",
        "transport",
    )

    def __init__(self, listener: HttpListener) -> None:
        self.listener = listener
        self.parser = RequestParser(listener.max_body)
        self.transport: asyncio.Transport | None = None
        self.busy: asyncio.Task[None] | None = None
        self.active_at = 0.0  # loop time of the last byte read, or of the last answer
        self.closing = False
        self.lingering = False
        self.paused = False

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
        if self.busy is None:
            self._next()
        elif self.parser.buffered > PAUSE_BUFFERED_BYTES and not self.paused:
            self.paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        if self.busy is None or self.lingering:
            self.close()
        return True  # a request being served still gets its answer, then the close

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()

    def _linger(self) -> None:
        """Answered for the last time: send our end's EOF, then drop what still comes."""
        transport = self.transport
        assert transport is not None
        self.closing = self.lingering = True
        if self.paused:
            self.paused = False
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        self.listener.loop.call_later(LINGER_SECONDS, transport.close)

    def _next(self) -> None:
        """Serve the next whole request, if one has arrived."""
        if self.closing:
            return
        transport = self.transport
        assert transport is not None
        try:
            request = self.parser.next_request()
        except HttpError as exc:
            self.listener.refused += 1
            reply = Reply.error(exc.status, exc.message)
            transport.write(response(exc.status, reply.body, reply.content_type, keep_alive=False))
            self._linger()
            return
        if request is None:
            if self.parser.take_continue():
                transport.write(CONTINUE)
            if self.paused:
                self.paused = False
                transport.resume_reading()
            return
        found = self.listener.routes.find(request.method, request.path)
        if isinstance(found, Reply):
            self._answer(request, found)
            return
        self.busy = self.listener.loop.create_task(self._serve(request, found(request)))

    async def _serve(self, request: Request, reply: Awaitable[Reply]) -> None:
        try:
            answer = await reply
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            answer = Reply.error(500, "internal error")
        self.busy = None
        self._answer(request, answer)

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
        elif self.parser.buffered:
            self._next()  # a pipelined request is waiting
        elif self.paused:
            self.paused = False
            self.transport.resume_reading()


class HttpListener:
    """The server: its connections, their sweep, and a graceful stop."""

    def __init__(self, routes: Routes, max_body: int) -> None:
        self.routes = routes
        self.max_body = max_body
        self.loop = asyncio.get_running_loop()
        self.connections: set[HttpConnection] = set()
        self.stopping = False
        self.refused = 0  # requests answered 4xx/5xx by the parser
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
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
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
