"""The hub: this node's sessions, their indexes, and routing from the bus to sockets.

Every event enters the cluster once (``publish``), crosses the bus, and each
node picks its own recipients from indexes kept up to date on subscribe and
watch. No path here scans all connections.

Python API for services (stable):

- ``positions = await node.publish(message)`` where
  ``message = protocol.parse.parse_broadcast(body_bytes)`` (or the same
  :class:`~protocol.messages.Broadcast` built directly). It is the one door for
  every event: ``game``/``chat`` go to the game's stream, a ``UserEvent`` to
  each addressed user's stream, ``test`` to every node. The returned
  ``dict[str, Position]`` maps each stream written to the event's position
  (empty for ``test``, and when Redis is unreachable and the event could only
  be delivered on this node, unpositioned).
- Streams (``protocol.streams``): ``game:<meta>#<id>`` and ``user:<userId>``.
  Each node keeps a cursor per stream it holds and repairs gaps from the
  history (``Streams.read``) before it delivers anything later; when it cannot,
  or when the epoch changed, its stream-speaking clients get
  ``recovered: false``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from contextlib import AsyncExitStack

from protocol.envelope import (
    encode_envelope,
)
from protocol.errors import CloseCode, ErrorCode
from protocol.messages import (
    AdminTest,
    Broadcast,
    GameEvent,
    GameKey,
    Position,
    Since,
    Subscribe,
)
from protocol.streams import (
    game_stream,
    user_stream,
)
from server.auth.verify import Authenticator, AuthError, AuthUnavailable
from server.bus.base import Bus
from server.bus.streams import Append, Streams
from server.bus.topics import (
    ADMIN,
    ALL_GAMES,
    NODE_TOPICS,
    game_topic,
)
from server.config import Settings
from server.presence.core import (
    PresenceBackend,
)
from server.presence.node_presence import NodePresence
from server.routing.delivery import StreamDelivery
from server.routing.history_reads import HistoryReads
from server.routing.index import (
    HubIndex,
    StreamState,
    kept_stream_state,
    restore_stream_state,
)
from server.routing.recovery import Recovery
from server.routing.subscribe_batching import SubscribeBatcher
from server.runtime.connection_rows import ConnectionRegistry
from server.runtime.metrics import REGISTRY
from server.runtime.tasks import cancel_and_wait
from server.services import Coordination, Service
from server.services.bots import BotService
from server.services.chat import ChatService
from server.services.chat_marks import ChatMarks
from server.services.last_seen import LastSeen
from server.session import Session
from server.store.base import CONNECTION_TTL_SECONDS, ConnectionRecord, Store, ttl_from_now

log = logging.getLogger(__name__)

RELOAD_ATTEMPTS = 20
"""Tries to reload presence after a bus reconnect (about 15 s of backoff in all)."""
SYNC_PRESENCE_INTERVAL = 1.0
"""Seconds between two snapshots answering one connection's syncPresence."""

events_published = REGISTRY.counter("ap_events_published_total", "Events accepted for fan-out")


DRAIN_BATCH_SECONDS = 0.1
"""One batch of drain closes per this interval: 100 batches over the default 10 s."""


STOP_DRAIN_SECONDS = 2.0


class Node:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        bus: Bus,
        presence_backend: PresenceBackend,
        authenticator: Authenticator,
        streams: Streams,
        coordination: Coordination,
    ) -> None:
        self.settings = settings
        self.streams = streams
        self.node_id = settings.node_id
        self.store = store
        self.bus = bus
        self.presence_backend = presence_backend
        self.authenticator = authenticator
        self.registry = ConnectionRegistry(store)
        self.bots = BotService(store, settings.bot_max_connections, settings.outbox_limit_bytes)
        self._outbox_limit = settings.outbox_limit_bytes
        self.index = HubIndex(settings, bus, released=self._released)
        self.sessions = self.index.sessions
        self.last_seen = LastSeen(store, coordination.last_seen_claims)
        self.presence = NodePresence(
            settings,
            presence_backend,
            store,
            self.index.sessions,
            self.index.presence_watchers,
            self.last_seen.seen,
        )
        # Every history read (recovery, repair) goes out in batches.
        self.history = HistoryReads(streams)
        self.delivery = StreamDelivery(
            self.index,
            self.history,
            self.presence,
            lambda session: self.bots.send_pending_turns(self, session),
            self._outbox_limit,
        )
        self.recovery = Recovery(self.history, SubscribeBatcher(bus), self._outbox_limit)
        self._running = AsyncExitStack()  # the stops of what started, for ``stop``
        self.services: list[Service] = []  # started after the node, stopped before it
        self.ready = False
        self.draining = False
        self._sessions_gone = asyncio.Event()  # set when a drain has closed the last one
        self.chat_marks = ChatMarks(store)
        self.chat = ChatService(
            store,
            self.publish,
            coordination.game_locks,
            coordination.chat_limiter,
            self.chat_marks,
            self._outbox_limit,
        )

    def _released(self, stream: str) -> None:
        self.delivery.forget(stream)

    # --- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Start every part in order, then be ready.

        Each part's stop goes on one ``AsyncExitStack`` just before the part
        starts (a start that fails half-way still closes what it opened): a
        failed or cancelled start closes exactly what started, in reverse
        order, and ``stop`` unwinds the same stack.
        """
        async with AsyncExitStack() as stack:
            await self._start(stack)
            self._running = stack.pop_all()
        self.ready = True

    async def _start(self, stack: AsyncExitStack) -> None:
        stack.push_async_callback(self.store.close)
        await self.store.start()
        stack.push_async_callback(self.authenticator.close)
        stale = await self.store.delete_endpoint_connections(self.node_id)
        if stale:
            log.info("deleted %d connection rows left by an earlier run of %s", stale, self.node_id)
        stack.push_async_callback(self.presence_backend.close)
        await self.presence_backend.start()
        stack.push_async_callback(self.streams.close)
        await self.streams.start()
        stack.push_async_callback(self.bus.close)
        await self.bus.start(self.delivery.on_bus_message)
        await self.bus.subscribe(NODE_TOPICS)
        stack.push_async_callback(self.recovery.close)
        stack.push_async_callback(self.history.close)
        stack.callback(self.delivery.cancel)
        stack.push_async_callback(self._delete_rows)
        stack.push_async_callback(self.registry.close)
        self.registry.start()
        stack.push_async_callback(self.index.topics.close)
        self.index.topics.start()
        stack.push_async_callback(self.chat.close)
        stack.push_async_callback(self.last_seen.close)
        self.last_seen.start()
        stack.push_async_callback(self.chat_marks.close)
        self.chat_marks.start()
        stack.push_async_callback(self._let_writes_out)
        await self.presence.start(stack)
        ttl = asyncio.create_task(self._ttl_loop(), name="ttl-refresh")
        stack.push_async_callback(cancel_and_wait, ttl)
        stack.push_async_callback(self._close_sessions)
        for service in self.services:
            stack.push_async_callback(_stop_service, service)
            await service.start()

    async def drain(self, seconds: float) -> int:
        """Close every session with 1012, spread over ``seconds`` in jittered batches.

        Returns how many sessions it closed.

        Closing all at once sends every client to the other nodes in the same
        second. Each closed user stays reported by this node until its own
        connection is gone, so one who reconnects elsewhere is never offline in
        the cluster's view; the presence writer's debounce absorbs the move.
        The caller has stopped the listener; ``/readyz`` answers 503 from here on.
        """
        self.ready = False
        self.draining = True
        sessions = list(self.sessions)
        if not sessions:
            return 0
        random.shuffle(sessions)
        batches = max(1, min(len(sessions), round(seconds / DRAIN_BATCH_SECONDS)))
        loop = asyncio.get_running_loop()
        started = loop.time()
        # Batch i closes at a random moment of the i-th slice of the window.
        moments = [started + seconds * (i + random.random()) / batches for i in range(batches)]
        log.info("draining %d sessions over %gs in %d batches", len(sessions), seconds, batches)
        for i, moment in enumerate(moments):
            await asyncio.sleep(max(0.0, moment - loop.time()))
            for session in sessions[i::batches]:
                session.close(CloseCode.SERVICE_RESTART, "server restarting")
        for session in list(self.sessions):  # any that slipped in while the listener closed
            session.close(CloseCode.SERVICE_RESTART, "server restarting")
        closing = [s.close_task for s in sessions if s.close_task is not None]
        if closing:
            await asyncio.wait(closing, timeout=self.settings.close_timeout)
        # Report the last leaves, then give the writer one more window: a user
        # who did not come back leaves now, one who moved does not flap. The
        # rows were deleted behind, in batches: let the last batch go out too.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.drain_move_grace_ms / 1000 + 10):
                if self.sessions:  # handlers still finishing their close
                    await self._sessions_gone.wait()
                await self.presence.drained()
                await self.registry.drained()
        await asyncio.sleep(2 * self.settings.presence_debounce)
        log.info("drained in %.1fs", loop.time() - started)
        return len(sessions)

    async def stop(self) -> None:
        """Stop the services, close every session, stop every part, delete this
        node's rows: what ``start`` started, in reverse order (nothing twice)."""
        self.ready = False
        await self._running.aclose()

    async def _close_sessions(self) -> None:
        sessions = list(self.sessions)
        for session in sessions:
            session.close(CloseCode.SERVICE_RESTART, "server restarting")
        closing = [s.close_task for s in sessions if s.close_task is not None]
        if closing:
            await asyncio.wait(closing, timeout=5)

    async def _let_writes_out(self) -> None:
        """Marks and lastSeen already queued get a moment to reach the store."""
        for pending in (self.chat_marks, self.last_seen):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pending.drained(), STOP_DRAIN_SECONDS)

    async def _delete_rows(self) -> None:
        with contextlib.suppress(Exception):
            await self.store.delete_endpoint_connections(self.node_id)

    # --- sessions -----------------------------------------------------------

    def opened(self, session: Session) -> None:
        self.sessions.add(session)

    def closed(self, session: Session) -> None:
        self.sessions.discard(session)
        if self.draining and not self.sessions:
            self._sessions_gone.set()
        if not session.subscribed:
            return
        user_id = session.user_id
        assert user_id is not None
        self.index.remove(session)
        self.registry.delete(session.connection_id)
        if session.is_bot:
            return  # bots are not in presence: nothing to report, now or after a grace
        if self.draining:
            self.presence.left_for_another_node(user_id, session.invisible)
        else:
            self.presence.left(user_id, session.invisible)

    async def subscribe(self, session: Session, action: Subscribe) -> None:
        try:
            identity = await self.authenticator.verify(action.token)
        except AuthUnavailable as exc:
            # Not the client's fault: a clear reason, and a code that says "retry".
            session.send_error(ErrorCode.UNAVAILABLE, str(exc), self._outbox_limit)
            session.close(CloseCode.TRY_AGAIN_LATER, "token cannot be checked now")
            return
        except AuthError as exc:
            session.send_error(ErrorCode.UNAUTHORIZED, str(exc), self._outbox_limit)
            session.close(CloseCode.POLICY_VIOLATION, "invalid token")
            return
        bot = identity.kind == "bot"
        if bot and not await self.bots.admit(
            session, identity.user_id, lambda: self.index.by_user.get(identity.user_id, ())
        ):
            return
        if session not in self.sessions:
            return  # closed while the token was checked
        kept: StreamState = ({}, {})
        if session.subscribed:
            if session.user_id != identity.user_id:
                session.send_error(
                    ErrorCode.USER_MISMATCH,
                    "this connection is subscribed as another user",
                    self._outbox_limit,
                )
                return
            kept = kept_stream_state(session, None)
            self.index.remove(session)
            if not session.is_bot:
                # Reported together with the join below, as one change.
                self.presence.local.remove(identity.user_id, session.invisible)
        elif not self.index.admit_user(session, identity.user_id):
            return
        games = action.games if action.games is not None else frozenset()
        if not self.index.games_allowed(session, identity.user_id, games):
            games = frozenset()
        session.user_id = identity.user_id
        session.kind = identity.kind
        session.invisible = action.invisible
        # Bots get no presence unless they ask, and never fall back to legacy routing.
        wants = action.wants_presence
        session.wants_presence = wants if wants is not None else not bot
        session.watch_version = action.watch_version
        if bot and session.watch_version is None:
            session.watch_version = 1
        session.watching = games
        session.row_ttl = ttl_from_now()
        if action.since is not None and session.positions is None:
            session.positions = {}
        self.index.add(session)
        restore_stream_state(session, kept)
        if not bot:
            self.presence.joined(identity.user_id, session.invisible)
        self.registry.put(self._record(session))
        self.last_seen.seen(identity.user_id)
        if session.wants_presence:
            # The snapshot and this session's place among delta recipients are
            # taken in the same loop turn, so it misses no delta after the snapshot.
            self.presence.send_snapshot(session)
        if action.since is not None:
            await self.recovery.recover(session, action.since)
        if bot:
            # After recovery: a recovered:false is followed by a fresh list.
            await self.bots.send_pending_turns(self, session)

    async def watch(
        self, session: Session, games: frozenset[GameKey], since: Since | None = None
    ) -> None:
        assert session.user_id is not None
        if not self.index.games_allowed(session, session.user_id, games, len(session.watching)):
            return
        unchanged = (
            games == session.watching
            and session.watch_version == 1
            and (since is None or session.speaks_streams)
        )
        # The browser sends the same watchGames after its subscribe, 250 ms and
        # 1 s later: nothing to re-index, and no row write (in a reconnect storm,
        # three store writes per client that change nothing).
        if not unchanged:
            kept = kept_stream_state(
                session, {game_stream(key) for key in games & session.watching}
            )
            self.index.remove_games(session)
            if since is not None and session.positions is None:
                session.positions = {}
            session.watching = games
            session.watch_version = 1
            self.index.add_games(session)
            restore_stream_state(session, kept)
            session.row_ttl = ttl_from_now()
            self.registry.watch(session.connection_id, games, 1, session.row_ttl)
        if since is not None:
            await self.recovery.recover(session, since)

    def _record(self, session: Session) -> ConnectionRecord:
        assert session.user_id is not None
        return ConnectionRecord(
            connection_id=session.connection_id,
            user_id=session.user_id,
            invisible=session.invisible,
            endpoint=self.node_id,
            wants_presence=session.wants_presence,
            watch_version=session.watch_version,
            watching_games=session.watching,
            ttl=session.row_ttl,
        )

    def rewrite_rows(self) -> None:
        """Write every session's row again: the cluster presumed this node dead and
        deleted them while it was only unreachable."""
        for session in self.sessions:
            if session.subscribed:
                self.registry.put(self._record(session))

    async def _ttl_loop(self) -> None:
        """Push forward the ttl of rows that live longer than it."""
        interval = self.settings.ttl_refresh_seconds
        while True:
            await asyncio.sleep(interval)
            horizon = time.time() + CONNECTION_TTL_SECONDS - interval * 2
            for session in list(self.sessions):
                if session.subscribed and session.row_ttl < horizon:
                    session.row_ttl = ttl_from_now()
                    self.registry.refresh_ttl(session.connection_id, session.row_ttl)

    # --- events -------------------------------------------------------------

    async def publish(
        self, message: Broadcast, *, require_cluster: bool = False, event_id: str | None = None
    ) -> dict[str, Position]:
        """The one door into the cluster for every event; returns the positions taken.

        ``game``/``chat`` take the next position of ``game:<meta>#<id>`` (and
        reach legacy clients through the ``games`` topic in the same step); a
        ``UserEvent`` takes one in each addressed ``user:<id>``; ``test`` has no
        stream. When the bus is down, the event is delivered on this node only,
        unpositioned, and no positions are returned. With ``require_cluster`` it
        raises instead (:class:`~server.bus.base.BusDown`, or the streams' error):
        the queue bridge and the notification push then keep the event and retry.

        ``event_id`` names the event (an SQS MessageId, a notification row's
        sk): published again within 15 minutes, it is not appended or delivered
        again, and each stream answers the position it took the first time.
        """
        events_published.inc()
        data = encode_envelope(message)
        event = message.event
        if isinstance(event, AdminTest):
            await self.bus.publish(ADMIN, data, local_fallback=not require_cluster)
            return {}
        if isinstance(event, GameEvent):
            stream = game_stream(event.key)
            items = [Append(stream, data, (game_topic(event.key), ALL_GAMES), event_id)]
        else:
            # Each user stream remembers the id: a retry finds it in every one.
            items = [Append(user_stream(u), data, (user_stream(u),), event_id) for u in event.users]
        try:
            positions = await self.streams.append_many(items)
        except Exception:
            if self.bus.connected or require_cluster:
                raise
            # Redis is away: nobody can assign positions, but this node's own
            # clients still hear of the event (they are told to refetch later).
            log.warning("streams unreachable: %s delivered on this node only", event.verb)
            for item in items:
                self.delivery.deliver_unpositioned(item.stream, message)
            return {}
        return {item.stream: position for item, position in zip(items, positions, strict=True)}

    def resync(self) -> None:
        """The bus reconnected and may have lost messages: see ``NodePresence.resync``."""
        self.presence.resync()

    def sync_presence(self, session: Session) -> None:
        self.presence.sync(session)

    def check_streams(self) -> None:
        self.delivery.check_streams()


async def _stop_service(service: Service) -> None:
    try:
        await service.stop()
    except Exception:
        log.exception("stopping %s failed", type(service).__name__)
