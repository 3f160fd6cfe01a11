"""One socket's session: identity, watch set, and its bounded outbox.

The outbox is the transport's own write buffer plus what the kernel holds
for the socket: a frame is written at once, and a session whose unsent bytes
are over the limit is a slow consumer and is closed. No per-client queue or
task sits between an event and the socket. Every write to a client goes
through :func:`send_frame`, synchronously, so frames reach a socket in the
order the node sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import logging
import random
import socket
import struct
import termios
import uuid
from collections.abc import Iterable, Sequence

from websockets.asyncio.server import ServerConnection
from websockets.frames import DATA_OPCODES
from websockets.frames import Frame as WsFrame
from websockets.protocol import State

from protocol.codec import Frame
from protocol.errors import MSGPACK_SUBPROTOCOL, CloseCode, ErrorCode
from protocol.messages import Broadcast, ErrorMessage, GameKey, Subscribe
from server.runtime.metrics import REGISTRY
from server.runtime.token_bucket import TokenBucket
from server.store.base import ConnectionRecord, ttl_from_now

log = logging.getLogger(__name__)

frames_sent = REGISTRY.counter("ap_frames_sent_total", "Frames written to client sockets")
slow_consumers = REGISTRY.counter(
    "ap_slow_consumers_total", "Connections closed because their outbox overflowed"
)

_ids = itertools.count()

DRAIN_BATCH_SECONDS = 0.1
"""One batch of drain closes per this interval: 100 batches over the default 10 s."""


class Session:
    """The server's view of one client connection."""

    __slots__ = (
        "acking",
        "binary",
        "close_task",
        "connection_id",
        "credits",
        "deadline",
        "heartbeat",
        "invisible",
        "kernel_capacity",
        "kind",
        "positions",
        "recovering",
        "row_ttl",
        "sync_at",
        "sync_pending",
        "user_id",
        "wants_presence",
        "watch_version",
        "watching",
        "ws",
    )

    def __init__(self, ws: ServerConnection, credits: TokenBucket | None = None) -> None:
        if ws.protocol.extensions:
            # send_frame writes pre-framed bytes, valid only without extensions.
            raise ValueError("sessions do not support WebSocket extensions")
        self.ws = ws
        self.connection_id = f"{uuid.uuid4().hex[:20]}{next(_ids):x}"
        self.binary = ws.subprotocol == MSGPACK_SUBPROTOCOL
        self.user_id: str | None = None
        self.kind = "human"  # or "bot": bots are not counted in presence
        self.invisible = False
        self.wants_presence = True
        self.watch_version: int | None = None
        self.watching: frozenset[GameKey] = frozenset()
        self.row_ttl = 0
        self.close_task: asyncio.Task[None] | None = None
        self.credits = credits  # frames this socket may still send (flood control)
        self.deadline: asyncio.TimerHandle | None = None  # closes it if it never subscribes
        self.sync_at = -1e9  # loop time of the last syncPresence answer
        self.sync_pending = False  # an answer is scheduled for the end of that second
        self.kernel_capacity = kernel_send_capacity(ws)
        # Stream speakers only (they sent ``since``): stream -> last (epoch, offset)
        # sent, so that replay and live never duplicate. None: a plain client.
        self.positions: dict[str, tuple[str, int]] | None = None
        # Streams being recovered -> live events buffered until the replay is sent.
        self.recovering: dict[str, list[tuple[str, int, Broadcast]]] = {}
        # The ``ackId`` of the action being handled: its error frames carry it.
        self.acking: str | None = None
        self.heartbeat = False  # asked for heartbeat frames in its subscribe

    @property
    def subscribed(self) -> bool:
        return self.user_id is not None

    @property
    def is_bot(self) -> bool:
        return self.kind == "bot"

    @property
    def speaks_streams(self) -> bool:
        return self.positions is not None

    @property
    def legacy(self) -> bool:
        """A client that never asked for targeted watch gets every game event."""
        return self.watch_version is None and not self.watching

    def send(self, frame: Frame, outbox_limit: int) -> None:
        """Write one frame now, or close the session if it cannot keep up."""
        send_frame([self], frame, outbox_limit)

    def send_error(
        self,
        code: ErrorCode,
        message: str,
        outbox_limit: int,
        client_msg_id: str | None = None,
    ) -> None:
        error = ErrorMessage(code, message, client_msg_id, self.acking)
        self.send(Frame(error), outbox_limit)

    def close(self, code: CloseCode, reason: str) -> None:
        """Start the closing handshake without waiting for it."""
        if self.close_task is None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None
            self.close_task = asyncio.create_task(self._close(code, reason))

    async def _close(self, code: CloseCode, reason: str) -> None:
        # ws.close() first waits for the write buffer to drain, which a client
        # that does not read never lets happen: bound the whole handshake.
        # The close frame is queued behind the unsent data, so a client that
        # reads again within --close-timeout still sees the code.
        ws = self.ws
        try:
            async with asyncio.timeout(ws.close_timeout):
                await ws.close(code, reason)
        except TimeoutError:
            ws.transport.abort()

    def unsent_bytes(self, outbox_limit: int) -> int:
        """Bytes written but not yet sent: user space, and the kernel's part when it matters.

        The kernel's share is read (``SIOCOUTQ``) only when it could tip the
        sum over ``outbox_limit``, so the common path costs no system call.
        """
        transport = self.ws.transport
        queued = transport.get_write_buffer_size()
        if queued + self.kernel_capacity <= outbox_limit:
            return queued
        return queued + kernel_unsent(transport, self.kernel_capacity)

    def over_limit(self, outbox_limit: int) -> bool:
        return self.unsent_bytes(outbox_limit) > outbox_limit

    def take_subscribe(
        self, user_id: str, kind: str, action: Subscribe, games: frozenset[GameKey]
    ) -> None:
        """Become ``user_id`` with what ``action`` asks (``games``: the watch set allowed)."""
        bot = kind == "bot"
        self.user_id = user_id
        self.kind = kind
        self.invisible = action.invisible
        # Bots get no presence unless they ask, and never fall back to legacy routing.
        wants = action.wants_presence
        self.wants_presence = wants if wants is not None else not bot
        self.watch_version = action.watch_version
        if bot and self.watch_version is None:
            self.watch_version = 1
        self.watching = games
        self.heartbeat = action.heartbeat
        self.row_ttl = ttl_from_now()
        if action.since is not None and self.positions is None:
            self.positions = {}

    def row(self, endpoint: str) -> ConnectionRecord:
        """This subscribed session's ``wsConnections`` row, on node ``endpoint``."""
        assert self.user_id is not None
        return ConnectionRecord(
            connection_id=self.connection_id,
            user_id=self.user_id,
            invisible=self.invisible,
            endpoint=endpoint,
            wants_presence=self.wants_presence,
            watch_version=self.watch_version,
            watching_games=self.watching,
            ttl=self.row_ttl,
        )

    def __repr__(self) -> str:
        return f"<Session {self.connection_id} user={self.user_id}>"


async def close_spread_out(
    sessions: Sequence[Session], seconds: float, code: CloseCode, reason: str
) -> None:
    """Close ``sessions`` over ``seconds`` in jittered batches, in a random order:
    closed all at once, their clients would all reconnect elsewhere in the same second."""
    if not sessions:
        return
    order = list(sessions)
    random.shuffle(order)
    batches = max(1, min(len(order), round(seconds / DRAIN_BATCH_SECONDS)))
    loop = asyncio.get_running_loop()
    started = loop.time()
    # Batch i closes at a random moment of the i-th slice of the window.
    moments = [started + seconds * (i + random.random()) / batches for i in range(batches)]
    log.info("draining %d sessions over %gs in %d batches", len(order), seconds, batches)
    for i, moment in enumerate(moments):
        await asyncio.sleep(max(0.0, moment - loop.time()))
        for session in order[i::batches]:
            session.close(code, reason)


async def wait_closed(sessions: Iterable[Session], within: float) -> None:
    """Return once every closing handshake of ``sessions`` is over, or after ``within`` s."""
    closing = [s.close_task for s in sessions if s.close_task is not None]
    if closing:
        await asyncio.wait(closing, timeout=within)


def send_frame(sessions: Iterable[Session], frame: Frame, outbox_limit: int) -> int:
    """Write ``frame`` to every open session; returns how many got it.

    The WebSocket frame is serialized once per format and its bytes go straight
    to each transport (what ``websockets.broadcast`` does, minus framing the
    same bytes again per socket). Sessions whose outbox is over ``outbox_limit``
    bytes are closed as slow consumers instead; nobody else waits for them.
    """
    sent = 0
    for session in sessions:
        ws = session.ws
        if ws.protocol.state is not State.OPEN or session.close_task is not None:
            continue
        transport = ws.transport
        if (
            transport.get_write_buffer_size() + session.kernel_capacity > outbox_limit
            and session.over_limit(outbox_limit)
        ):
            close_slow_consumer(session)
            continue
        transport.write(frame.binary_wire if session.binary else frame.text_wire)
        sent += 1
    frames_sent.inc(sent)
    return sent


def send_frames(session: Session, frames: Sequence[Frame], outbox_limit: int) -> bool:
    """Write ``frames`` to one session, in order, in one write: a replay of many
    events costs one system call rather than one per event. False when the
    session is closed or closing (as a slow consumer, if over ``outbox_limit``)."""
    if not frames:
        return True
    ws = session.ws
    if ws.protocol.state is not State.OPEN or session.close_task is not None:
        return False
    transport = ws.transport
    if (
        transport.get_write_buffer_size() + session.kernel_capacity > outbox_limit
        and session.over_limit(outbox_limit)
    ):
        close_slow_consumer(session)
        return False
    if session.binary:
        transport.write(b"".join([frame.binary_wire for frame in frames]))
    else:
        transport.write(b"".join([frame.text_wire for frame in frames]))
    frames_sent.inc(len(frames))
    return True


def close_slow_consumer(session: Session) -> None:
    if session.close_task is None:
        slow_consumers.inc()
        log.info(
            "closing slow consumer %s", session, extra={"connection_id": session.connection_id}
        )
        session.close(CloseCode.SLOW_CONSUMER, "slow consumer")


# --- the kernel's part of the outbox -------------------------------------------

_SIOCOUTQ = getattr(termios, "TIOCOUTQ", None)  # the same request as SIOCOUTQ on Linux


def kernel_send_capacity(ws: ServerConnection) -> int:
    """Most bytes the kernel may hold for this socket (SO_SNDBUF as the kernel reports it)."""
    sock = ws.transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        capacity: int = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    except OSError:
        return 0
    return capacity


def kernel_unsent(transport: asyncio.BaseTransport, capacity: int) -> int:
    """Bytes in the kernel's send queue; ``capacity`` where that cannot be read."""
    sock = transport.get_extra_info("socket")
    if sock is None or _SIOCOUTQ is None:
        return capacity
    try:
        raw = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return capacity
    unsent: int = struct.unpack("i", raw)[0]
    return unsent


# --- the socket: bounds that apply before any frame reaches the handler --------

flooders = REGISTRY.counter(
    "ap_flood_closes_total", "Connections closed for sending frames faster than their credits"
)
frames_parsed = REGISTRY.counter(
    "ap_frames_received_total", "WebSocket frames parsed from clients (data and control)"
)


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
    outbox_limit = 1024 * 1024
    send_buffer_bytes = 0
    flooded = False

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
        frames_parsed.inc()
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
        flooders.inc()
        self.flooded = True
        log.info("closing flooder %s", session)
        session.send_error(ErrorCode.RATE_LIMITED, "too many frames: slow down", self.outbox_limit)
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
