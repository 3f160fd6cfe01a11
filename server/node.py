"""The hub: this node's sessions, their indexes, and routing from the bus to sockets.

Every event enters the cluster once (``publish``), crosses the bus, and each
node picks its own recipients from indexes kept up to date on subscribe and
watch. No path here scans all connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from protocol.codec import Frame
from protocol.envelope import EnvelopeError, PresenceHint, decode_envelope, encode_envelope
from protocol.errors import CloseCode, ErrorCode
from protocol.messages import (
    AdminTest,
    Broadcast,
    GameEvent,
    GameKey,
    PresenceDelta,
    Subscribe,
)
from server.auth import Authenticator, AuthError
from server.batching import CoalescingFlusher
from server.bus.base import Bus
from server.bus.topics import (
    ADMIN,
    ALL_GAMES,
    GAME_PREFIX,
    NODE_TOPICS,
    PRESENCE,
    PRESENCE_HINTS,
    game_topic,
)
from server.config import Settings
from server.connection import Session, send_frame
from server.metrics import REGISTRY
from server.presence import (
    LocalPresence,
    PresenceBackend,
    PresenceView,
    PresenceWriter,
    presence_resyncs,
)
from server.registry import ConnectionRegistry
from server.store.base import CONNECTION_TTL_SECONDS, ConnectionRecord, Store, ttl_from_now

log = logging.getLogger(__name__)

RELOAD_ATTEMPTS = 20
"""Tries to reload presence after a bus reconnect (about 15 s of backoff in all)."""

events_published = REGISTRY.counter("ap_events_published_total", "Events accepted for fan-out")
events_received = REGISTRY.counter("ap_bus_messages_total", "Envelopes received from the bus")
bad_envelopes = REGISTRY.counter("ap_bus_bad_envelopes_total", "Envelopes that failed to decode")
bus_failures = REGISTRY.counter(
    "ap_bus_subscription_retries_total", "Bus subscription changes that failed and were retried"
)


class Node:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        bus: Bus,
        presence_backend: PresenceBackend,
        authenticator: Authenticator,
    ) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.store = store
        self.bus = bus
        self.presence_backend = presence_backend
        self.authenticator = authenticator
        self.registry = ConnectionRegistry(store)
        self.local_presence = LocalPresence()
        self.view = PresenceView()
        self.writer = PresenceWriter(presence_backend, store, settings.presence_debounce)
        self.sessions: set[Session] = set()
        self.by_user: dict[str, set[Session]] = {}
        self.by_game: dict[GameKey, set[Session]] = {}
        self.legacy: set[Session] = set()
        self.presence_watchers: set[Session] = set()
        self._outbox_limit = settings.outbox_limit_bytes
        self._topics: CoalescingFlusher[str, bool] = CoalescingFlusher(
            "bus-topics", self._apply_topics, lambda _old, new: new, bus_failures
        )
        self._reports: CoalescingFlusher[str, bool | None] = CoalescingFlusher(
            "presence-reports", self._report, lambda _old, new: new, bus_failures
        )
        # None asks the delta loop to reload the view and push fresh snapshots.
        self._reports_since: float | None = None  # when the oldest unreported change happened
        self._deltas: asyncio.Queue[PresenceDelta | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.ready = False
        REGISTRY.gauge("ap_connections", "Open WebSocket sessions", lambda: len(self.sessions))
        REGISTRY.gauge("ap_users", "Distinct users on this node", self._user_count)
        REGISTRY.gauge("ap_presence_seq", "Seq of this node's presence view", lambda: self.view.seq)
        REGISTRY.gauge("ap_watched_games", "Games watched on this node", lambda: len(self.by_game))

    def _user_count(self) -> float:
        return float(self.local_presence.user_count)

    # --- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        await self.store.start()
        stale = await self.store.delete_endpoint_connections(self.node_id)
        if stale:
            log.info("deleted %d connection rows left by an earlier run of %s", stale, self.node_id)
        await self.presence_backend.start()
        await self.bus.start(self._on_bus_message)
        await self.bus.subscribe(NODE_TOPICS)
        self.view.reset(await self.presence_backend.committed())
        self.registry.start()
        self._topics.start()
        self._reports.start()
        self.writer.start()
        self._tasks = [
            asyncio.create_task(self._delta_loop(), name="presence-deltas"),
            asyncio.create_task(self._ttl_loop(), name="ttl-refresh"),
        ]
        self.ready = True

    async def stop(self) -> None:
        """Close every session, then delete this node's rows."""
        self.ready = False
        sessions = list(self.sessions)
        for session in sessions:
            session.close(CloseCode.SERVICE_RESTART, "server restarting")
        closing = [s.close_task for s in sessions if s.close_task is not None]
        if closing:
            await asyncio.wait(closing, timeout=5)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.writer.close()
        await self._reports.close()
        await self._topics.close()
        await self.registry.close()
        with contextlib.suppress(Exception):
            await self.store.delete_endpoint_connections(self.node_id)
        await self.bus.close()
        await self.presence_backend.close()
        await self.store.close()

    # --- sessions -----------------------------------------------------------

    def opened(self, session: Session) -> None:
        self.sessions.add(session)

    def closed(self, session: Session) -> None:
        self.sessions.discard(session)
        if not session.subscribed:
            return
        user_id = session.user_id
        assert user_id is not None
        self._unindex(session)
        self.local_presence.remove(user_id, session.invisible)
        self._queue_reports()
        self.registry.delete(session.connection_id)

    async def subscribe(self, session: Session, action: Subscribe) -> None:
        try:
            identity = await self.authenticator.verify(action.token)
        except AuthError as exc:
            session.send_error(ErrorCode.UNAUTHORIZED, str(exc), self._outbox_limit)
            session.close(CloseCode.POLICY_VIOLATION, "invalid token")
            return
        if session not in self.sessions:
            return  # closed while the token was checked
        if session.subscribed:
            if session.user_id != identity.user_id:
                session.send_error(
                    ErrorCode.USER_MISMATCH,
                    "this connection is subscribed as another user",
                    self._outbox_limit,
                )
                return
            self._unindex(session)
            self.local_presence.remove(identity.user_id, session.invisible)
        session.user_id = identity.user_id
        session.invisible = action.invisible
        session.wants_presence = action.wants_presence
        session.watch_version = action.watch_version
        session.watching = action.games if action.games is not None else frozenset()
        session.row_ttl = ttl_from_now()
        self._index(session)
        self.local_presence.add(identity.user_id, session.invisible)
        self._queue_reports()
        self.registry.put(self._record(session))
        if session.wants_presence:
            # The snapshot and this session's place among delta recipients are
            # taken in the same loop turn, so it misses no delta after the snapshot.
            session.send(self.view.snapshot_frame(), self._outbox_limit)

    def watch(self, session: Session, games: frozenset[GameKey]) -> None:
        self._unindex_games(session)
        session.watching = games
        session.watch_version = 1
        self._index_games(session)
        session.row_ttl = ttl_from_now()
        self.registry.watch(session.connection_id, games, 1, session.row_ttl)

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

    def resync(self) -> None:
        """The bus reconnected and may have lost messages: reload the presence view
        and send every presence watcher a fresh snapshot; the writer looks at everyone."""
        self._deltas.put_nowait(None)
        self.writer.reconcile()

    def sync_presence(self, session: Session) -> None:
        session.send(self.view.snapshot_frame(), self._outbox_limit)

    def _index(self, session: Session) -> None:
        assert session.user_id is not None
        self.by_user.setdefault(session.user_id, set()).add(session)
        if session.wants_presence:
            self.presence_watchers.add(session)
        self._index_games(session)

    def _unindex(self, session: Session) -> None:
        assert session.user_id is not None
        users = self.by_user.get(session.user_id)
        if users is not None:
            users.discard(session)
            if not users:
                del self.by_user[session.user_id]
        self.presence_watchers.discard(session)
        self._unindex_games(session)

    def _index_games(self, session: Session) -> None:
        if session.legacy:
            if not self.legacy:
                self._topics.put(ALL_GAMES, True)
            self.legacy.add(session)
            return
        for key in session.watching:
            watchers = self.by_game.get(key)
            if watchers is None:
                watchers = self.by_game[key] = set()
                self._topics.put(game_topic(key), True)
            watchers.add(session)

    def _unindex_games(self, session: Session) -> None:
        if session in self.legacy:
            self.legacy.discard(session)
            if not self.legacy:
                self._topics.put(ALL_GAMES, False)
            return
        for key in session.watching:
            watchers = self.by_game.get(key)
            if watchers is None:
                continue
            watchers.discard(session)
            if not watchers:
                del self.by_game[key]
                self._topics.put(game_topic(key), False)

    async def _apply_topics(self, batch: dict[str, bool]) -> dict[str, bool]:
        wanted = [topic for topic, on in batch.items() if on]
        unwanted = [topic for topic, on in batch.items() if not on]
        if wanted:
            await self.bus.subscribe(wanted)
        if unwanted:
            await self.bus.unsubscribe(unwanted)
        return {}

    def _queue_reports(self) -> None:
        pending = self.local_presence.take_pending()
        if pending and self._reports_since is None:
            self._reports_since = time.time()
        for user_id, state in pending.items():
            self._reports.put(user_id, state)

    async def _report(self, batch: dict[str, bool | None]) -> dict[str, bool | None]:
        since, self._reports_since = self._reports_since, None
        await self.presence_backend.report(batch, time.time() if since is None else since)
        return {}

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

    async def publish(self, message: Broadcast) -> None:
        """The one door into the cluster for game events and admin broadcasts."""
        events_published.inc()
        data = encode_envelope(message)
        event = message.event
        if isinstance(event, GameEvent):
            await self.bus.publish(game_topic(event.key), data)
            await self.bus.publish(ALL_GAMES, data)
        else:
            await self.bus.publish(ADMIN, data)

    def _on_bus_message(self, topic: str, data: bytes) -> None:
        events_received.inc()
        try:
            envelope = decode_envelope(data)
        except EnvelopeError as exc:
            bad_envelopes.inc()
            log.warning("dropped envelope on %s: %s", topic, exc)
            return
        if isinstance(envelope, Broadcast):
            self._route(topic, envelope)
        elif isinstance(envelope, PresenceDelta) and topic == PRESENCE:
            self._deltas.put_nowait(envelope)
        elif isinstance(envelope, PresenceHint) and topic == PRESENCE_HINTS:
            self.writer.hint(envelope.user_ids, envelope.changed_at)

    def _route(self, topic: str, message: Broadcast) -> None:
        event = message.event
        recipients: set[Session] | list[Session]
        if isinstance(event, AdminTest):
            recipients = [s for s in self.sessions if s.subscribed]
        elif topic == ALL_GAMES:
            recipients = self.legacy
        elif topic.startswith(GAME_PREFIX) and topic == game_topic(event.key):
            recipients = self.by_game.get(event.key, set())
        else:
            return
        if message.exclude:
            recipients = [s for s in recipients if s.user_id not in message.exclude]
        if recipients:
            send_frame(recipients, Frame(event), self._outbox_limit)

    async def _delta_loop(self) -> None:
        while True:
            delta = await self._deltas.get()
            if delta is None:
                await self._reload_view()
                continue
            if delta.seq <= self.view.seq:
                continue  # already applied (a reload got ahead of it)
            if delta.seq != self.view.seq + 1:
                # A gap in what this node heard: read the committed state again.
                # Clients see the gap too and repair it with syncPresence.
                presence_resyncs.inc()
                log.warning("presence gap at node: have %d, got %d", self.view.seq, delta.seq)
                try:
                    self.view.reset(await self.presence_backend.committed())
                except Exception as exc:
                    log.warning("presence reload failed: %s", exc)
                if delta.seq == self.view.seq + 1:
                    self.view.apply(delta)
            else:
                self.view.apply(delta)
            send_frame(self.presence_watchers, Frame(delta), self._outbox_limit)

    async def _reload_view(self) -> None:
        presence_resyncs.inc()
        # Right after a reconnect Redis may still refuse (a cluster still
        # electing, a client on a stale slot map): retry rather than leave the
        # watchers without the snapshot that covers what they missed.
        delay = 0.1
        for attempt in range(RELOAD_ATTEMPTS):
            try:
                self.view.reset(await self.presence_backend.committed())
                break
            except Exception as exc:
                if attempt == RELOAD_ATTEMPTS - 1:
                    log.warning("presence reload after a bus reconnect failed: %s", exc)
                    return
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
        send_frame(self.presence_watchers, self.view.snapshot_frame(), self._outbox_limit)
