"""One socket's session: identity, watch set, and its bounded outbox.

The outbox is the transport's own write buffer: a frame is written at once,
and a session whose buffer is over the limit is a slow consumer and is
closed. No per-client queue or task sits between an event and the socket.
Every write to a client goes through :func:`send_frame`, synchronously, so
frames reach a socket in the order the node sends them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Iterable

from websockets.asyncio.server import ServerConnection
from websockets.protocol import State

from protocol.codec import Frame
from protocol.errors import MSGPACK_SUBPROTOCOL, CloseCode, ErrorCode
from protocol.messages import Broadcast, ErrorMessage, GameKey
from server.metrics import REGISTRY

log = logging.getLogger(__name__)

frames_sent = REGISTRY.counter("ap_frames_sent_total", "Frames written to client sockets")
slow_consumers = REGISTRY.counter(
    "ap_slow_consumers_total", "Connections closed because their outbox overflowed"
)

_ids = itertools.count()


class Session:
    """The server's view of one client connection."""

    __slots__ = (
        "binary",
        "close_task",
        "connection_id",
        "invisible",
        "positions",
        "recovering",
        "row_ttl",
        "user_id",
        "wants_presence",
        "watch_version",
        "watching",
        "ws",
    )

    def __init__(self, ws: ServerConnection) -> None:
        if ws.protocol.extensions:
            # send_frame writes pre-framed bytes, valid only without extensions.
            raise ValueError("sessions do not support WebSocket extensions")
        self.ws = ws
        self.connection_id = f"{uuid.uuid4().hex[:20]}{next(_ids):x}"
        self.binary = ws.subprotocol == MSGPACK_SUBPROTOCOL
        self.user_id: str | None = None
        self.invisible = False
        self.wants_presence = True
        self.watch_version: int | None = None
        self.watching: frozenset[GameKey] = frozenset()
        self.row_ttl = 0
        self.close_task: asyncio.Task[None] | None = None
        # Stream speakers only (they sent ``since``): stream -> last (epoch, offset)
        # sent, so that replay and live never duplicate. None: a plain client.
        self.positions: dict[str, tuple[str, int]] | None = None
        # Streams being recovered -> live events buffered until the replay is sent.
        self.recovering: dict[str, list[tuple[str, int, Broadcast]]] = {}

    @property
    def subscribed(self) -> bool:
        return self.user_id is not None

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
        self.send(Frame(ErrorMessage(code, message, client_msg_id)), outbox_limit)

    def close(self, code: CloseCode, reason: str) -> None:
        """Start the closing handshake without waiting for it."""
        if self.close_task is None:
            self.close_task = asyncio.create_task(self.ws.close(code, reason))

    def __repr__(self) -> str:
        return f"<Session {self.connection_id} user={self.user_id}>"


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
        if transport.get_write_buffer_size() > outbox_limit:
            slow_consumers.inc()
            log.info("closing slow consumer %s", session)
            session.close(CloseCode.SLOW_CONSUMER, "slow consumer")
            continue
        transport.write(frame.binary_wire if session.binary else frame.text_wire)
        sent += 1
    frames_sent.inc(sent)
    return sent
