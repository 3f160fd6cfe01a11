"""The WebSocket door: admission before the upgrade, then one handler per socket.

``Admission`` answers 503 before any WebSocket state exists; ``Handler`` reads a
socket's frames in order and hands each action to the hub. The door reaches the
hub only through :class:`SessionHub`: sessions in and out, and their actions.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence, Set
from http import HTTPStatus
from typing import Protocol

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from protocol.codec import Frame
from protocol.errors import (
    MAX_FRAME_BYTES,
    MSGPACK_SUBPROTOCOL,
    CloseCode,
    ErrorCode,
    ProtocolError,
)
from protocol.messages import Ack, Chat, GameKey, Since, Subscribe, SyncPresence, WatchGames
from protocol.parse import parse_client_frame
from server.config import Settings
from server.ingress.connection import GuardedConnection
from server.routing.keepalive import start_clock
from server.runtime import logs
from server.runtime.metrics import Registry
from server.runtime.rate_window import RateWindow
from server.runtime.reclaim import Reclaimer
from server.runtime.token_bucket import TokenBucket
from server.session import Session, Traffic


class ChatDoor(Protocol):
    async def post(self, session: Session, action: Chat) -> None: ...


class SessionHub(Protocol):
    """What the WebSocket door needs of the hub (``server.node.Node`` is one)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def sessions(self) -> Set[Session]: ...

    @property
    def metrics(self) -> Registry: ...

    @property
    def traffic(self) -> Traffic: ...

    @property
    def chat(self) -> ChatDoor: ...

    def opened(self, session: Session) -> None: ...

    def closed(self, session: Session) -> None: ...

    async def subscribe(self, session: Session, action: Subscribe) -> bool: ...

    async def watch(
        self, session: Session, games: frozenset[GameKey], since: Since | None = None
    ) -> bool: ...

    def sync_presence(self, session: Session) -> None: ...


async def serve_websocket(node: SessionHub, reclaimer: Reclaimer | None = None) -> Server:
    """Listen for clients: admission, then a handler per socket, on a guarded connection."""
    settings = node.settings
    guarded = type(
        "NodeConnection",
        (GuardedConnection,),
        {
            "outbox_limit": settings.outbox_limit_bytes,
            "send_buffer_bytes": settings.socket_send_buffer_bytes,
            "traffic": node.traffic,
        },
    )
    return await serve(
        Handler(node, reclaimer),
        settings.host,
        settings.port,
        select_subprotocol=select_subprotocol,
        compression=None,  # frames are tiny; deflate would cost ~50 KiB per socket
        max_size=MAX_FRAME_BYTES,
        ping_interval=None,  # server.routing.keepalive pings every socket from one sweep
        ping_timeout=None,
        close_timeout=settings.close_timeout,
        backlog=settings.listen_backlog,
        create_connection=guarded,
        process_request=Admission(node).check,
    )


def select_subprotocol(
    connection: ServerConnection, offered: Sequence[Subprotocol]
) -> Subprotocol | None:
    # Browsers offer none and get JSON; clients that ask for msgpack get it.
    return Subprotocol(MSGPACK_SUBPROTOCOL) if MSGPACK_SUBPROTOCOL in offered else None


class Handler:
    """Runs one socket's session: read frames in order, act, answer."""

    def __init__(self, node: SessionHub, reclaimer: Reclaimer | None = None) -> None:
        self.node = node
        self.reclaimer = reclaimer
        settings = node.settings
        self.limit = settings.outbox_limit_bytes
        self.credits = settings.flood_credits
        self.refill = settings.flood_credits / settings.flood_window_seconds
        self.subscribe_timeout = settings.subscribe_timeout
        self.bad_frames = node.metrics.counter(
            "ap_client_errors_total", "Client frames answered with an error"
        )

    async def __call__(self, ws: ServerConnection) -> None:
        # The library's subprotocol callback closes over the connection, which
        # holds the protocol that holds the callback: a cycle that outlives the
        # socket until a full collection. The handshake is over; drop it.
        vars(ws.protocol).pop("select_subprotocol", None)
        forget_handshake(ws)
        loop = asyncio.get_running_loop()
        credits = TokenBucket(self.credits, self.refill, loop.time())
        session = Session(ws, credits, traffic=self.node.traffic)
        start_clock(session, loop.time(), self.node.settings.ping_interval)
        logs.connection_id.set(session.connection_id)  # this task serves only this socket
        if isinstance(ws, GuardedConnection):
            ws.attach(session)
        if self.subscribe_timeout > 0:
            session.deadline = loop.call_later(self.subscribe_timeout, self._deadline, session)
        self.node.opened(session)
        try:
            async for data in ws:
                if session.close_task is None:  # a flooder's backlog is not worth handling
                    await self.receive(session, data)
                # Frames already buffered come without a pause: let other sockets
                # and the fan-out run between two of this one's frames.
                await asyncio.sleep(0)
        except ConnectionClosed:
            pass
        finally:
            if session.deadline is not None:
                session.deadline.cancel()
            self.node.closed(session)
            if isinstance(ws, GuardedConnection):
                ws.attach(None)  # no cycle between a closed socket and its session
            if self.reclaimer is not None:
                self.reclaimer.closed()

    @staticmethod
    def _deadline(session: Session) -> None:
        session.deadline = None
        if not session.subscribed:
            session.close(CloseCode.SUBSCRIBE_DEADLINE, "no subscribe in time")

    async def receive(self, session: Session, data: str | bytes) -> None:
        try:
            action = parse_client_frame(data)
        except ProtocolError as exc:
            self.bad_frames.inc()
            session.acking = exc.ack_id
            session.send_error(exc.code, exc.message, self.limit, exc.client_msg_id)
            session.acking = None
            if exc.code is ErrorCode.UNAUTHORIZED:
                # subscribe without a usable token: refused like a bad one
                session.close(CloseCode.POLICY_VIOLATION, "invalid token")
            return
        if isinstance(action, Subscribe | WatchGames):
            # Every error frame of the action carries its ackId; the ack comes last.
            session.acking = action.ack_id
            try:
                applied = await self._apply(session, action)
            finally:
                session.acking = None
            if applied and action.ack_id is not None:
                session.send(Frame(self._ack(action)), self.limit)
        elif not session.subscribed:
            self.bad_frames.inc()
            session.send_error(ErrorCode.NOT_SUBSCRIBED, "Not subscribed", self.limit)
        elif isinstance(action, SyncPresence):
            self.node.sync_presence(session)
        elif isinstance(action, Chat):
            await self.node.chat.post(session, action)

    async def _apply(self, session: Session, action: Subscribe | WatchGames) -> bool:
        if isinstance(action, Subscribe):
            return await self.node.subscribe(session, action)
        if not session.subscribed:
            self.bad_frames.inc()
            session.send_error(ErrorCode.NOT_SUBSCRIBED, "Not subscribed", self.limit)
            return False
        return await self.node.watch(session, action.games, action.since)

    def _ack(self, action: Subscribe | WatchGames) -> Ack:
        assert action.ack_id is not None
        if isinstance(action, WatchGames):
            return Ack(action.ack_id, "watchGames")
        beat = self.node.settings.heartbeat_seconds if action.heartbeat else None
        return Ack(action.ack_id, "subscribe", beat)


HANDLED_REQUEST = Request("/", Headers())
"""What a connection keeps as its request once the handshake is over."""


def forget_handshake(ws: ServerConnection) -> None:
    """Drop the upgrade's request and response, never read after the handshake.

    The collector walks what a connection keeps for the socket's whole life
    (in a 5,000-client reconnect storm it took a fifth of the node's CPU):
    measured, 98 tracked objects per subscribed socket with the headers, 90
    without, and their strings besides. The library takes a non-None
    ``request`` to mean that the next event is a frame, so a shared empty one
    stands in for it (``tests/test_hardening.py`` checks both).
    """
    ws.request = HANDLED_REQUEST
    ws.response = None


class Admission:
    """Paces upgrades before any WebSocket state exists, and refuses what it cannot pace.

    Over the accept rate, an upgrade is held until its turn in a sliding window
    (never more than the rate in any one second), for up to
    ``--accept-queue-seconds``: a reconnect storm of a few thousand sockets is
    admitted at the rate, none refused. Past that wait, or
    over the node's connection cap, the upgrade gets 503 (with Retry-After).
    A held upgrade costs its socket and this coroutine, nothing more.
    """

    def __init__(self, node: SessionHub) -> None:
        self.node = node
        settings = node.settings
        self.max_connections = settings.max_connections
        self.refused = node.metrics.counter(
            "ap_refused_upgrades_total", "WebSocket upgrades answered 503 (node cap or accept rate)"
        )
        self.accepted = node.metrics.counter(
            "ap_accepted_upgrades_total",
            "WebSocket upgrades admitted past the node cap and accept rate",
        )
        self.paced = node.metrics.counter(
            "ap_paced_upgrades_total",
            "WebSocket upgrades held for their turn under the accept rate, then admitted",
        )
        self.queue_seconds = settings.accept_queue_seconds
        self.window: RateWindow | None = None
        if settings.accept_rate > 0:
            rate = settings.accept_rate
            # whole admissions per second; below one, one per 1/rate seconds
            whole = math.floor(rate)
            self.window = RateWindow(whole) if whole >= 1 else RateWindow(1, 1 / rate)

    async def check(self, connection: ServerConnection, request: Request) -> Response | None:
        if self._full():
            return self._refuse(connection, "node is full\n")
        window = self.window
        if window is not None:
            now = asyncio.get_running_loop().time()
            wait = window.reserve(now, self.queue_seconds)
            if wait is None:
                response = self._refuse(connection, "too many new connections\n")
                response.headers["Retry-After"] = str(window.retry_after(now))
                return response
            if wait > 0:
                await asyncio.sleep(wait)
                self.paced.inc()
                if self._full():  # it filled up meanwhile
                    return self._refuse(connection, "node is full\n")
        self.accepted.inc()
        return None

    def _full(self) -> bool:
        return bool(self.max_connections) and len(self.node.sessions) >= self.max_connections

    def _refuse(self, connection: ServerConnection, why: str) -> Response:
        self.refused.inc()
        return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, why)
