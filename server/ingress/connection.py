"""The websockets connection the listener makes: bounds that apply before any
frame reaches a handler.

Every incoming frame spends flood credits as it is parsed (reads are parsed in
slices, so a flood is cut off within a slice), the library's automatic replies
(pongs) count against the outbox, any bytes read mark the peer alive for the
keepalive sweep, and a closed connection drops the cycles that would keep it
in memory until an old-generation collection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from websockets.asyncio.server import ServerConnection
from websockets.frames import DATA_OPCODES
from websockets.frames import Frame as WsFrame
from websockets.protocol import State

from protocol.errors import CloseCode, ErrorCode
from server.session import Session, Traffic, close_slow_consumer

log = logging.getLogger(__name__)

READ_SLICE_BYTES = 4096
"""Incoming bytes are parsed this much at a time, with credits taken in between."""

FRAME_CREDIT_BYTES = 4096
"""A frame costs one flood credit, plus one per full 4 KiB it carries: handling
a 50 KB watchGames costs what a dozen small frames do."""


def _stay_paused() -> None:
    pass


class GuardedConnection(ServerConnection):
    """A server connection whose every incoming frame spends flood credits, and
    whose automatic replies (pongs) count against the outbox like any frame.

    The library answers each ping with a pong written straight to the socket;
    a client that pings and never reads would otherwise grow that buffer
    without bound, outside any check the node makes.
    """

    session: Session | None = None
    traffic: Traffic  # its node's, set by the listener on the class it makes per node
    outbox_limit = 1024 * 1024
    send_buffer_bytes = 0
    flooded = False

    def attach(self, session: Session | None) -> None:
        """``session`` serves this connection from now on (None: none does)."""
        self.session = session
        if session is not None:
            session.write_paused = self.paused

    # The transport pauses its protocol past the write buffer's high-water mark:
    # mirrored on the session, where the fan-out reads it with the rest of its state.

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.session is not None:
            self.session.write_paused = True

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.session is not None:
            self.session.write_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and self.send_buffer_bytes > 0:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        # A connection that ends without a closing handshake leaves the parser's
        # EOFError, whose traceback holds the parser's frame, which holds the
        # protocol: a cycle the raised collector thresholds keep for a long
        # time. The traceback is of no use once the socket is gone.
        parser_exc = self.protocol.parser_exc
        if parser_exc is not None:
            parser_exc.__traceback__ = None
            parser_exc.__context__ = None
        # asyncio's socket transport keeps its read callback as a bound method
        # of itself (CPython 3.11): every closed transport is a cycle, ~1 KiB
        # that only a collection of an older generation frees. It reads no more.
        with contextlib.suppress(TypeError):
            vars(self.transport).pop("_read_ready_cb", None)

    def data_received(self, data: bytes) -> None:
        session = self.session
        if session is not None:
            session.heard_at = self.loop.time()  # alive: the keepalive's measure
        if session is None or len(data) <= READ_SLICE_BYTES:
            super().data_received(data)
        else:
            # One read may carry 256 KiB: ~13,000 tiny frames, and the library
            # parses a whole read before any credit is taken. Parsed in slices,
            # a flood is cut off within a slice of where its credits ran out.
            for start in range(0, len(data), READ_SLICE_BYTES):
                if self.flooded:
                    break  # nothing more it sends is read
                super().data_received(data[start : start + READ_SLICE_BYTES])
        if session is None or self.protocol.state is not State.OPEN:
            if session is not None and session.over_limit(2 * self.outbox_limit):
                # Closing already, and still growing: stop waiting for the handshake.
                self.transport.abort()
            return
        if session.over_limit(self.outbox_limit):
            close_slow_consumer(session)

    def process_event(self, event: object) -> None:
        self.traffic.frames_parsed += 1
        session = self.session
        if (
            session is not None
            and session.credits is not None
            and isinstance(event, WsFrame)
            and self.protocol.state is State.OPEN
            and not session.credits.take(
                self.loop.time(), 1 + len(event.data) // FRAME_CREDIT_BYTES
            )
        ):
            self._flooded(session)
        if self.flooded and isinstance(event, WsFrame) and event.opcode in DATA_OPCODES:
            return  # the rest of a flooder's read: not worth queueing for the handler
        super().process_event(event)  # type: ignore[arg-type]

    def _flooded(self, session: Session) -> None:
        if session.close_task is not None:
            return
        self.traffic.flood_closes += 1
        self.flooded = True
        log.info("closing flooder %s", session)
        session.send_error(ErrorCode.RATE_LIMITED, "too many frames: slow down", self.outbox_limit)
        session.write_pending()  # the error before the close frame written below
        # Nothing more it sends is worth reading: what it already sent may be
        # megabytes, and its close reply would sit behind them. So: the close
        # frame and our end of the stream go out now, reading stops for good
        # (the message queue would otherwise resume it as the handler drains),
        # and the socket is dropped after --close-timeout at the latest.
        self.protocol.send_close(CloseCode.POLICY_VIOLATION, "rate limited")
        self.protocol.send_eof()
        self.send_data()
        self.recv_messages.resume = _stay_paused
        self.transport.pause_reading()
        session.close(CloseCode.POLICY_VIOLATION, "rate limited")
