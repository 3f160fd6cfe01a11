"""The WebSocket door: admission before the upgrade, then one handler per socket.

``Admission`` answers 503 before any WebSocket state exists; ``Handler`` reads a
socket's frames in order and hands each action to the hub. The door reaches the
hub only through :class:`SessionHub`: sessions in and out, and their actions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence, Set
from http import HTTPStatus
from typing import Protocol

from websockets.asyncio.server import Server, ServerConnection, serve
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
from server.runtime import logs
from server.runtime.metrics import REGISTRY
from server.runtime.reclaim import Reclaimer
from server.runtime.token_bucket import TokenBucket
from server.session import GuardedConnection, Session

bad_frames = REGISTRY.counter("ap_client_errors_total", "Client frames answered with an error")


class ChatDoor(Protocol):
    async def post(self, session: Session, action: Chat) -> None: ...


class SessionHub(Protocol):
    """What the WebSocket door needs of the hub (``server.node.Node`` is one)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def sessions(self) -> Set[Session]: ...

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
        },
    )
    return await serve(
        Handler(node, reclaimer),
        settings.host,
        settings.port,
        select_subprotocol=select_subprotocol,
        compression=None,  # frames are tiny; deflate would cost ~50 KiB per socket
        max_size=MAX_FRAME_BYTES,
        ping_interval=settings.ping_interval,
        ping_timeout=settings.ping_timeout,
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

    async def __call__(self, ws: ServerConnection) -> None:
        # The library's subprotocol callback closes over the connection, which
        # holds the protocol that holds the callback: a cycle that outlives the
        # socket until a full collection. The handshake is over; drop it.
        vars(ws.protocol).pop("select_subprotocol", None)
        loop = asyncio.get_running_loop()
        session = Session(ws, TokenBucket(self.credits, self.refill, loop.time()))
        logs.connection_id.set(session.connection_id)  # this task serves only this socket
        if isinstance(ws, GuardedConnection):
            ws.session = session
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
                ws.session = None  # no cycle between a closed socket and its session
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
            bad_frames.inc()
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
            bad_frames.inc()
            session.send_error(ErrorCode.NOT_SUBSCRIBED, "Not subscribed", self.limit)
        elif isinstance(action, SyncPresence):
            self.node.sync_presence(session)
        elif isinstance(action, Chat):
            await self.node.chat.post(session, action)

    async def _apply(self, session: Session, action: Subscribe | WatchGames) -> bool:
        if isinstance(action, Subscribe):
            return await self.node.subscribe(session, action)
        if not session.subscribed:
            bad_frames.inc()
            session.send_error(ErrorCode.NOT_SUBSCRIBED, "Not subscribed", self.limit)
            return False
        return await self.node.watch(session, action.games, action.since)

    def _ack(self, action: Subscribe | WatchGames) -> Ack:
        assert action.ack_id is not None
        if isinstance(action, WatchGames):
            return Ack(action.ack_id, "watchGames")
        beat = self.node.settings.heartbeat_seconds if action.heartbeat else None
        return Ack(action.ack_id, "subscribe", beat)


refused_upgrades = REGISTRY.counter(
    "ap_refused_upgrades_total", "WebSocket upgrades answered 503 (node cap or accept rate)"
)
accepted_upgrades = REGISTRY.counter(
    "ap_accepted_upgrades_total", "WebSocket upgrades admitted past the node cap and accept rate"
)


class Admission:
    """Refuses upgrades with 503 before any WebSocket state exists: over the
    node's connection cap, or faster than the accept rate (with Retry-After)."""

    def __init__(self, node: SessionHub) -> None:
        self.node = node
        settings = node.settings
        self.max_connections = settings.max_connections
        self.bucket: TokenBucket | None = None
        if settings.accept_rate > 0:
            rate = settings.accept_rate
            self.bucket = TokenBucket(rate, rate, asyncio.get_running_loop().time())

    def check(self, connection: ServerConnection, request: Request) -> Response | None:
        if self.max_connections and len(self.node.sessions) >= self.max_connections:
            refused_upgrades.inc()
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "node is full\n")
        bucket = self.bucket
        if bucket is not None:
            now = asyncio.get_running_loop().time()
            if not bucket.take(now):
                refused_upgrades.inc()
                response = connection.respond(
                    HTTPStatus.SERVICE_UNAVAILABLE, "too many new connections\n"
                )
                response.headers["Retry-After"] = str(bucket.retry_after(now))
                return response
        accepted_upgrades.inc()
        return None
