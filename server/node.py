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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol.codec import Frame
from protocol.envelope import (
    EnvelopeError,
    PositionedData,
    PresenceHint,
    decode_envelope,
    decode_positioned,
    encode_envelope,
    is_positioned,
)
from protocol.errors import CloseCode, ErrorCode
from protocol.messages import (
    AdminTest,
    Broadcast,
    GameEvent,
    GameKey,
    Heartbeat,
    Position,
    Positioned,
    PresenceDelta,
    Recovered,
    ServerMessage,
    Since,
    Skip,
    Subscribe,
    UserEvent,
)
from protocol.streams import (
    HistoryRead,
    Step,
    StreamCursor,
    game_stream,
    merge_recovery,
    stream_game,
    stream_user,
    user_stream,
)
from server.auth.verify import Authenticator, AuthError, AuthUnavailable
from server.bus.base import Bus
from server.bus.streams import Append, Streams
from server.bus.topics import (
    ADMIN,
    ALL_GAMES,
    NODE_TOPICS,
    PRESENCE,
    PRESENCE_HINTS,
    game_topic,
)
from server.config import Settings
from server.coordination.claims import Claims, MemoryClaims
from server.coordination.game_lock import GameLocks, MemoryGameLocks
from server.coordination.rate_limit import MemoryRateLimiter, RateLimiter
from server.presence.core import (
    LocalPresence,
    PresenceBackend,
    PresenceView,
    PresenceWriter,
    presence_resyncs,
)
from server.routing.history_reads import HistoryReads
from server.routing.subscribe_batching import SubscribeBatcher
from server.runtime.connection_rows import ConnectionRegistry
from server.runtime.metrics import REGISTRY
from server.runtime.write_behind import CoalescingFlusher
from server.services import Service
from server.services.bots import BotService
from server.services.chat import RATE_WINDOW_SECONDS, ChatService
from server.services.chat_marks import ChatMarks
from server.services.last_seen import LastSeen
from server.session import Session, send_frame, send_frames
from server.store.base import CONNECTION_TTL_SECONDS, ConnectionRecord, Store, ttl_from_now

log = logging.getLogger(__name__)

RELOAD_ATTEMPTS = 20
"""Tries to reload presence after a bus reconnect (about 15 s of backoff in all)."""
SYNC_PRESENCE_INTERVAL = 1.0
"""Seconds between two snapshots answering one connection's syncPresence."""

events_published = REGISTRY.counter("ap_events_published_total", "Events accepted for fan-out")
events_received = REGISTRY.counter("ap_bus_messages_total", "Envelopes received from the bus")
bad_envelopes = REGISTRY.counter("ap_bus_bad_envelopes_total", "Envelopes that failed to decode")
stream_gaps = REGISTRY.counter(
    "ap_stream_gaps_total", "Holes in a stream this node heard, repaired from history or not"
)
stream_losses = REGISTRY.counter(
    "ap_stream_losses_total", "Times this node told its clients recovered:false for a stream"
)
stream_repaired = REGISTRY.counter(
    "ap_stream_repaired_events_total", "Events this node missed live and delivered from history"
)
recoveries = REGISTRY.counter("ap_stream_recoveries_total", "Client recoveries answered")
recoveries_failed = REGISTRY.counter(
    "ap_stream_recoveries_failed_total", "Client recoveries answered with recovered:false"
)
bus_failures = REGISTRY.counter(
    "ap_bus_subscription_retries_total", "Bus subscription changes that failed and were retried"
)


DRAIN_BATCH_SECONDS = 0.1
"""One batch of drain closes per this interval: 100 batches over the default 10 s."""


@dataclass(frozen=True)
class Coordination:
    """What the services share across nodes: Redis parts in a cluster, memory alone."""

    game_locks: GameLocks
    chat_limiter: RateLimiter
    last_seen_claims: Claims

    @classmethod
    def in_memory(cls, settings: Settings) -> Coordination:
        return cls(
            MemoryGameLocks(),
            MemoryRateLimiter(settings.chat_rate, RATE_WINDOW_SECONDS),
            MemoryClaims(),
        )


STOP_DRAIN_SECONDS = 2.0

HEARTBEAT_FRAME = Frame(Heartbeat())
"""The same bytes for every socket and every tick: encoded once per process."""

REPLAY_FRAME_CACHE = 16384
"""Replayed frames (and ``recovered: true`` answers) kept, least recently used
out, for other clients recovering the same events: a storm over 1,000 games
with 10 missed events each replays 10,000 distinct frames (about 1 KB each)."""


class Node:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        bus: Bus,
        presence_backend: PresenceBackend,
        authenticator: Authenticator,
        streams: Streams,
        coordination: Coordination | None = None,
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
        self.local_presence = LocalPresence()
        self.view = PresenceView()
        self.writer = PresenceWriter(presence_backend, store, settings.presence_debounce)
        self.sessions: set[Session] = set()
        self.by_user: dict[str, set[Session]] = {}
        self.by_game: dict[GameKey, set[Session]] = {}
        self.legacy: set[Session] = set()
        self.presence_watchers: set[Session] = set()
        self.heartbeats: set[Session] = set()  # sessions that asked for heartbeat frames
        self.games_by_user: dict[str, int] = {}  # watched keys over a user's sessions
        # Stream speakers among a stream's recipients on this node: the rest share
        # one frame per event on the fast path.
        self.speakers: dict[str, set[Session]] = {}
        self.cursors: dict[str, StreamCursor] = {}
        # Streams whose hole is being filled from history -> events that arrived meanwhile.
        self._repairing: dict[str, list[tuple[PositionedData, Broadcast]]] = {}
        # Every history read (recovery, repair) goes out in batches.
        self.history = HistoryReads(streams)
        # And every subscribe a recovery waits for, so a storm's are a few calls.
        self._recovery_subscribes = SubscribeBatcher(bus)
        # Replayed frames, shared by every client recovering the same events.
        self._replay_frames: OrderedDict[tuple[str, str, int, str], Frame] = OrderedDict()
        self._background: set[asyncio.Task[None]] = set()
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
        self.services: list[Service] = []  # started after the node, stopped before it
        self.ready = False
        self.draining = False
        self._moving = 0  # drained sessions whose user is still reported here
        self._moves_done = asyncio.Event()
        self._sessions_gone = asyncio.Event()  # set when a drain has closed the last one
        shared = coordination if coordination is not None else Coordination.in_memory(settings)
        self.chat_marks = ChatMarks(store)
        self.chat = ChatService(
            store,
            self.publish,
            shared.game_locks,
            shared.chat_limiter,
            self.chat_marks,
            self._outbox_limit,
        )
        self.last_seen = LastSeen(store, shared.last_seen_claims)
        REGISTRY.gauge("ap_connections", "Open WebSocket sessions", lambda: len(self.sessions))
        REGISTRY.gauge("ap_users", "Distinct users on this node", self._user_count)
        REGISTRY.gauge("ap_presence_seq", "Seq of this node's presence view", lambda: self.view.seq)
        REGISTRY.gauge("ap_watched_games", "Games watched on this node", lambda: len(self.by_game))

    @property
    def report_backlog(self) -> int:
        """Presence changes of this node's users not yet reported to the cluster."""
        return self._reports.backlog

    def _user_count(self) -> float:
        return float(self.local_presence.user_count)

    # --- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Start every part; if any fails or start-up is cancelled, close what started."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        await self.store.start()
        stale = await self.store.delete_endpoint_connections(self.node_id)
        if stale:
            log.info("deleted %d connection rows left by an earlier run of %s", stale, self.node_id)
        await self.presence_backend.start()
        await self.streams.start()
        await self.bus.start(self._on_bus_message)
        await self.bus.subscribe(NODE_TOPICS)
        self.view.reset(await self.presence_backend.committed())
        self.registry.start()
        self._topics.start()
        self._reports.start()
        self.writer.start()
        self.chat_marks.start()
        self.last_seen.start()
        self._tasks = [
            asyncio.create_task(self._delta_loop(), name="presence-deltas"),
            asyncio.create_task(self._ttl_loop(), name="ttl-refresh"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeats"),
        ]
        for service in self.services:
            await service.start()
        self.ready = True

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
                if self._moving:
                    await self._moves_done.wait()
                await self._reports.drained()
                await self.registry.drained()
        await asyncio.sleep(2 * self.settings.presence_debounce)
        log.info("drained in %.1fs", loop.time() - started)
        return len(sessions)

    async def stop(self) -> None:
        """Close every session, then delete this node's rows.

        Safe on a node whose start failed half-way: each part closes only what it opened.
        """
        self.ready = False
        for service in reversed(self.services):
            try:
                await service.stop()
            except Exception:
                log.exception("stopping %s failed", type(service).__name__)
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
        # Marks and lastSeen already queued get a moment to reach the store.
        for pending in (self.chat_marks, self.last_seen):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pending.drained(), STOP_DRAIN_SECONDS)
        await self.chat_marks.close()
        await self.last_seen.close()
        await self.chat.close()
        await self._reports.close()
        await self._topics.close()
        await self.registry.close()
        with contextlib.suppress(Exception):
            await self.store.delete_endpoint_connections(self.node_id)
        for task in list(self._background):
            task.cancel()
        await self.history.close()
        await self._recovery_subscribes.close()
        await self.bus.close()
        await self.streams.close()
        await self.presence_backend.close()
        await self.authenticator.close()
        await self.store.close()

    # --- sessions -----------------------------------------------------------

    def opened(self, session: Session) -> None:
        self.sessions.add(session)

    def closed(self, session: Session) -> None:
        self.sessions.discard(session)
        self.heartbeats.discard(session)
        if self.draining and not self.sessions:
            self._sessions_gone.set()
        if not session.subscribed:
            return
        user_id = session.user_id
        assert user_id is not None
        self._unindex(session)
        self.registry.delete(session.connection_id)
        if session.is_bot:
            return  # bots are not in presence: nothing to report, now or after a grace
        if self.draining:
            # Sent away by the drain: the user counts as online here a while
            # longer, for their reconnect to another node to be reported first.
            self._moving += 1
            grace = self.settings.drain_move_grace_ms / 1000
            asyncio.get_running_loop().call_later(grace, self._moved, user_id, session.invisible)
            return
        self.local_presence.remove(user_id, session.invisible)
        self._queue_reports()

    def _moved(self, user_id: str, invisible: bool) -> None:
        self._moving -= 1
        self.local_presence.remove(user_id, invisible)
        self._queue_reports()
        if not self._moving:
            self._moves_done.set()

    async def subscribe(self, session: Session, action: Subscribe) -> bool:
        """Apply a subscribe; False when it was refused (the error frame is sent)."""
        try:
            identity = await self.authenticator.verify(action.token)
        except AuthUnavailable as exc:
            # Not the client's fault: a clear reason, and a code that says "retry".
            session.send_error(ErrorCode.UNAVAILABLE, str(exc), self._outbox_limit)
            session.close(CloseCode.TRY_AGAIN_LATER, "token cannot be checked now")
            return False
        except AuthError as exc:
            session.send_error(ErrorCode.UNAUTHORIZED, str(exc), self._outbox_limit)
            session.close(CloseCode.POLICY_VIOLATION, "invalid token")
            return False
        bot = identity.kind == "bot"
        if bot and not await self.bots.admit(
            session, identity.user_id, lambda: self.by_user.get(identity.user_id, ())
        ):
            return False
        if session not in self.sessions:
            return False  # closed while the token was checked
        kept: _KeptState = ({}, {})
        if session.subscribed:
            if session.user_id != identity.user_id:
                session.send_error(
                    ErrorCode.USER_MISMATCH,
                    "this connection is subscribed as another user",
                    self._outbox_limit,
                )
                return False
            kept = _kept_state(session, None)
            self._unindex(session)
            if not session.is_bot:
                self.local_presence.remove(identity.user_id, session.invisible)
        elif not self._admit_user(session, identity.user_id):
            return False
        games = action.games if action.games is not None else frozenset()
        if not self._games_allowed(session, identity.user_id, games):
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
        self._index(session)
        _restore_state(session, kept)
        if not bot:
            self.local_presence.add(identity.user_id, session.invisible)
            self._queue_reports()
        self.registry.put(self._record(session))
        self.last_seen.seen(identity.user_id)
        if action.heartbeat:
            self.heartbeats.add(session)
        else:
            self.heartbeats.discard(session)
        if session.wants_presence:
            # The snapshot and this session's place among delta recipients are
            # taken in the same loop turn, so it misses no delta after the snapshot.
            session.send(self.view.snapshot_frame(), self._outbox_limit)
        if action.since is not None:
            await self.recover(session, action.since)
        if bot:
            # After recovery: a recovered:false is followed by a fresh list.
            await self.bots.send_pending_turns(self, session)
        return session in self.sessions and session.close_task is None

    def _admit_user(self, session: Session, user_id: str) -> bool:
        """At most --max-connections-per-user sockets per user: each pins memory."""
        cap = self.settings.max_connections_per_user
        if len(self.by_user.get(user_id, ())) < cap:
            return True
        session.send_error(
            ErrorCode.TOO_MANY_CONNECTIONS,
            f"this user already has {cap} connections open",
            self._outbox_limit,
        )
        session.close(CloseCode.TOO_MANY_CONNECTIONS, "too many connections")
        return False

    def _games_allowed(
        self, session: Session, user_id: str, games: frozenset[GameKey], replacing: int = 0
    ) -> bool:
        """At most --max-watched-games-per-user keys over all of a user's sockets
        (``replacing``: keys of this session's that ``games`` replaces)."""
        cap = self.settings.max_watched_games_per_user
        held = self.games_by_user.get(user_id, 0) - replacing
        if held + len(games) <= cap:
            return True
        session.send_error(
            ErrorCode.TOO_MANY_GAMES,
            f"this user may watch at most {cap} games over all connections",
            self._outbox_limit,
        )
        return False

    async def watch(
        self, session: Session, games: frozenset[GameKey], since: Since | None = None
    ) -> bool:
        """Replace the watch set; False when it was refused (the old set stays)."""
        assert session.user_id is not None
        if not self._games_allowed(session, session.user_id, games, len(session.watching)):
            return False
        unchanged = (
            games == session.watching
            and session.watch_version == 1
            and (since is None or session.speaks_streams)
        )
        # The browser sends the same watchGames after its subscribe, 250 ms and
        # 1 s later: nothing to re-index, and no row write (in a reconnect storm,
        # three store writes per client that change nothing).
        if not unchanged:
            kept = _kept_state(session, {game_stream(key) for key in games & session.watching})
            self._unindex_games(session)
            if since is not None and session.positions is None:
                session.positions = {}
            session.watching = games
            session.watch_version = 1
            self._index_games(session)
            _restore_state(session, kept)
            session.row_ttl = ttl_from_now()
            self.registry.watch(session.connection_id, games, 1, session.row_ttl)
        if since is not None:
            await self.recover(session, since)
        return True

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
        """A snapshot now, or one at the end of the second that the last one opened:
        each costs the whole visible list, so a client asking in a loop gets at
        most one per second, and asks made meanwhile share it."""
        if session.sync_pending:
            return
        loop = asyncio.get_running_loop()
        wait = session.sync_at + SYNC_PRESENCE_INTERVAL - loop.time()
        if wait <= 0:
            self._send_sync(session)
        else:
            session.sync_pending = True
            loop.call_later(wait, self._send_sync, session)

    def _send_sync(self, session: Session) -> None:
        session.sync_pending = False
        session.sync_at = asyncio.get_running_loop().time()
        if session in self.sessions:
            session.send(self.view.snapshot_frame(), self._outbox_limit)
            if session.user_id is not None:
                self.last_seen.seen(session.user_id)

    def _index(self, session: Session) -> None:
        assert session.user_id is not None
        tabs = self.by_user.get(session.user_id)
        if tabs is None:
            tabs = self.by_user[session.user_id] = set()
            # Per-user channels: this node hears only the users it holds.
            self._topics.put(user_stream(session.user_id), True)
        tabs.add(session)
        if session.speaks_streams:
            self._add_speaker(user_stream(session.user_id), session)
        if session.wants_presence:
            self.presence_watchers.add(session)
        self._index_games(session)

    def _unindex(self, session: Session) -> None:
        assert session.user_id is not None
        stream = user_stream(session.user_id)
        users = self.by_user.get(session.user_id)
        if users is not None:
            users.discard(session)
            if not users:
                del self.by_user[session.user_id]
                self._topics.put(stream, False)
                self._forget_stream(stream)
        self._drop_speaker(stream, session)
        self.presence_watchers.discard(session)
        self._unindex_games(session)

    def _add_speaker(self, stream: str, session: Session) -> None:
        self.speakers.setdefault(stream, set()).add(session)

    def _drop_speaker(self, stream: str, session: Session) -> None:
        speakers = self.speakers.get(stream)
        if speakers is not None:
            speakers.discard(session)
            if not speakers:
                del self.speakers[stream]
        session.recovering.pop(stream, None)
        if session.positions is not None:
            session.positions.pop(stream, None)

    def _forget_stream(self, stream: str) -> None:
        """Nobody here holds the stream any more: its cursor would only go stale."""
        self.cursors.pop(stream, None)

    def _index_games(self, session: Session) -> None:
        if session.watching:
            assert session.user_id is not None
            user_id = session.user_id
            self.games_by_user[user_id] = self.games_by_user.get(user_id, 0) + len(session.watching)
        if session.legacy:
            if not self.legacy:
                self._topics.put(ALL_GAMES, True)
            self.legacy.add(session)
            return
        speaks = session.speaks_streams
        for key in session.watching:
            watchers = self.by_game.get(key)
            if watchers is None:
                watchers = self.by_game[key] = set()
                self._topics.put(game_topic(key), True)
            watchers.add(session)
            if speaks:
                self._add_speaker(game_stream(key), session)

    def _unindex_games(self, session: Session) -> None:
        if session.watching and session.user_id is not None:
            left = self.games_by_user.get(session.user_id, 0) - len(session.watching)
            if left > 0:
                self.games_by_user[session.user_id] = left
            else:
                self.games_by_user.pop(session.user_id, None)
        if session in self.legacy:
            self.legacy.discard(session)
            if not self.legacy:
                self._topics.put(ALL_GAMES, False)
            return
        for key in session.watching:
            stream = game_stream(key)
            self._drop_speaker(stream, session)
            watchers = self.by_game.get(key)
            if watchers is None:
                continue
            watchers.discard(session)
            if not watchers:
                del self.by_game[key]
                self._topics.put(game_topic(key), False)
                self._forget_stream(stream)

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

    async def _heartbeat_loop(self) -> None:
        """One timer for the node: every tick, one frame to every session that asked."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            if self.heartbeats:
                send_frame(list(self.heartbeats), HEARTBEAT_FRAME, self._outbox_limit)

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
                self._deliver_unpositioned(item.stream, message)
            return {}
        return {item.stream: position for item, position in zip(items, positions, strict=True)}

    def _on_bus_message(self, topic: str, data: bytes) -> None:
        events_received.inc()
        try:
            if is_positioned(data):
                positioned = decode_positioned(data)
                envelope = decode_envelope(positioned.data)
                if isinstance(envelope, Broadcast):
                    self._on_stream_event(topic, positioned, envelope)
                return
            envelope = decode_envelope(data)
        except EnvelopeError as exc:
            bad_envelopes.inc()
            log.warning("dropped envelope on %s: %s", topic, exc)
            return
        if isinstance(envelope, Broadcast):
            if isinstance(envelope.event, AdminTest):
                self._route_admin(envelope)
        elif isinstance(envelope, PresenceDelta) and topic == PRESENCE:
            self._deltas.put_nowait(envelope)
        elif isinstance(envelope, PresenceHint) and topic == PRESENCE_HINTS:
            self.writer.hint(envelope.user_ids, envelope.changed_at)

    def _route_admin(self, message: Broadcast) -> None:
        recipients: list[Session] = [s for s in self.sessions if s.subscribed]
        if message.exclude:
            recipients = [s for s in recipients if s.user_id not in message.exclude]
        if recipients:
            send_frame(recipients, Frame(message.event), self._outbox_limit)

    def _on_stream_event(self, topic: str, positioned: PositionedData, message: Broadcast) -> None:
        event = message.event
        if topic == ALL_GAMES:
            # Legacy clients: every game event, positioned but never tracked.
            if isinstance(event, GameEvent) and self.legacy:
                frame = Frame(
                    Positioned(event, game_stream(event.key), positioned.epoch, positioned.offset)
                )
                recipients = self._not_excluded(self.legacy, message.exclude)
                send_frame(recipients, frame, self._outbox_limit)
            return
        if isinstance(event, GameEvent):
            if topic != game_topic(event.key):
                return
        elif not isinstance(event, UserEvent) or stream_user(topic) is None:
            return
        pending = self._repairing.get(topic)
        if pending is not None:
            pending.append((positioned, message))
            return
        self._step(topic, positioned, message, repairing=False)

    def _step(
        self, stream: str, positioned: PositionedData, message: Broadcast, *, repairing: bool
    ) -> None:
        """Deliver one event in stream order, or start filling the hole before it."""
        epoch, offset = positioned.epoch, positioned.offset
        cursor = self.cursors.get(stream)
        if cursor is None:
            if not self._holds(stream):
                return  # a message in flight after the last watcher left
            cursor = self.cursors[stream] = StreamCursor()
        step = cursor.step(epoch, offset)
        if step is Step.DUPLICATE:
            return
        if step is Step.GAP:
            stream_gaps.inc()
            if not repairing:
                self._repairing[stream] = [(positioned, message)]
                self._spawn(self._repair(stream), f"repair {stream}")
                return
            # The history could not fill it: the watchers must refetch.
            self._lost(stream, epoch, offset - 1)
        elif step is Step.NEW_EPOCH:
            self._lost(stream, epoch, offset - 1)
        cursor.advance(epoch, offset)
        self._deliver(stream, epoch, offset, message)

    def _holds(self, stream: str) -> bool:
        game = stream_game(stream)
        if game is not None:
            return game in self.by_game
        user = stream_user(stream)
        return user is not None and user in self.by_user

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _repair(self, stream: str) -> None:
        """Fill a hole from history, then deliver what arrived meanwhile, in order."""
        cursor = self.cursors.get(stream)
        history: HistoryRead[Broadcast] | None = None
        if cursor is not None:
            try:
                history = await self.history.read(stream, cursor.offset)
            except Exception as exc:
                log.warning("history of %s unreadable, its watchers must refetch: %s", stream, exc)
        pending = self._repairing.pop(stream, [])
        cursor = self.cursors.get(stream)
        if cursor is None:
            return  # nobody here holds the stream any more
        if history is not None:
            entries = history.entries
            if history.epoch != cursor.epoch or (entries and entries[0][0] > cursor.offset + 1):
                # The hole is gone from history (or the stream has a new epoch):
                # the watchers must refetch, from just before what history still
                # holds, so that everyone still hears every event it has.
                base = entries[0][0] - 1 if entries else history.top
                self._lost(stream, history.epoch, base)
                cursor.advance(history.epoch, base)
            elif not entries and cursor.offset < history.top:
                self._lost(stream, history.epoch, history.top)
                cursor.advance(history.epoch, history.top)
            for offset, envelope in entries:
                if offset == cursor.offset + 1:
                    stream_repaired.inc()
                    cursor.advance(history.epoch, offset)
                    self._deliver(stream, history.epoch, offset, envelope)
        # Arrival order is stream order (Redis publishes a stream's events in order).
        for positioned, message in pending:
            self._step(stream, positioned, message, repairing=True)

    def _recipients(self, stream: str) -> set[Session]:
        game = stream_game(stream)
        if game is not None:
            return self.by_game.get(game, set())
        user = stream_user(stream)
        return self.by_user.get(user, set()) if user is not None else set()

    @staticmethod
    def _not_excluded(
        sessions: set[Session], exclude: frozenset[str]
    ) -> set[Session] | list[Session]:
        if not exclude:
            return sessions
        return [s for s in sessions if s.user_id not in exclude]

    def _deliver(self, stream: str, epoch: str, offset: int, message: Broadcast) -> None:
        recipients = self._recipients(stream)
        if not recipients:
            return
        event = message.event
        assert isinstance(event, GameEvent | UserEvent)
        frame = Frame(Positioned(event, stream, epoch, offset))
        speakers = self.speakers.get(stream)
        if speakers is None:
            # The fast path: nobody here speaks streams on this one.
            send_frame(self._not_excluded(recipients, message.exclude), frame, self._outbox_limit)
            return
        plain = recipients - speakers
        if plain:
            send_frame(self._not_excluded(plain, message.exclude), frame, self._outbox_limit)
        sends: list[Session] = []
        skips: list[Session] = []
        exclude = message.exclude
        for session in speakers:
            buffer = session.recovering.get(stream)
            if buffer is not None:
                buffer.append((epoch, offset, message))
                continue
            positions = session.positions
            assert positions is not None
            last = positions.get(stream)
            if last is not None and last[0] == epoch and offset <= last[1]:
                continue  # already sent by its replay
            positions[stream] = (epoch, offset)
            (skips if session.user_id in exclude else sends).append(session)
        if sends:
            send_frame(sends, frame, self._outbox_limit)
        if skips:
            send_frame(skips, Frame(Skip(stream, epoch, offset)), self._outbox_limit)

    def _deliver_unpositioned(self, stream: str, message: Broadcast) -> None:
        event = message.event
        recipients = self._not_excluded(self._recipients(stream), message.exclude)
        if isinstance(event, GameEvent) and self.legacy:
            recipients = [*recipients, *self._not_excluded(self.legacy, message.exclude)]
        if recipients:
            send_frame(recipients, Frame(event), self._outbox_limit)

    def _lost(self, stream: str, epoch: str, top: int) -> None:
        """This node cannot prove continuity on ``stream``: its speakers must refetch."""
        stream_losses.inc()
        frame = Frame(Recovered(stream, False, epoch, top))
        for session in self.speakers.get(stream, ()):
            if stream in session.recovering:
                continue  # its own recovery sees the same hole in its buffer
            assert session.positions is not None
            session.positions[stream] = (epoch, top)
            session.send(frame, self._outbox_limit)
            if session.is_bot and stream_user(stream) is not None:
                # Turns may be among what was lost: the bot gets its list afresh.
                self._spawn(self.bots.send_pending_turns(self, session), "pendingTurns")

    def check_streams(self) -> None:
        """The bus reconnected: events of any held stream may have been lost
        meanwhile, so compare each cursor with its stream's top and repair."""
        for stream in list(self.cursors):
            if stream not in self._repairing:
                self._repairing[stream] = []
                self._spawn(self._repair(stream), f"check {stream}")

    # --- recovery -----------------------------------------------------------

    def _entitled(self, session: Session, stream: str) -> bool:
        game = stream_game(stream)
        if game is not None:
            return game in session.watching
        return stream_user(stream) == session.user_id

    async def recover(self, session: Session, since: Since) -> None:
        """Answer ``since``: per entitled stream, the missed events then ``recovered``.

        The session buffers live events of a stream from before the history
        read until its replay is sent (in one loop turn, with the buffer), so
        the switch from replay to live loses and duplicates nothing.
        """
        wanted: list[tuple[str, Position]] = []
        for stream, position in since.items():
            if self._entitled(session, stream):
                session.recovering[stream] = []
                wanted.append((stream, position))
            else:
                session.send_error(
                    ErrorCode.STREAM_NOT_ALLOWED,
                    f"not entitled to stream {stream[:80]!r}: watch the game first, "
                    "or name your own user stream",
                    self._outbox_limit,
                )
        # Hear every stream of the session before answering, and before reading
        # any history: then history and live together cover everything
        # (docs/protocol.md, "Recovery"), and a stream speaker's next request is
        # handled only once its live streams are in place.
        assert session.user_id is not None
        streams = {game_stream(key) for key in session.watching}
        streams.add(user_stream(session.user_id))
        try:
            await self._recovery_subscribes.subscribe(streams)
        except Exception as exc:
            log.warning("subscribe before recovery failed: %s", exc)
        if not wanted:
            return
        reads = await asyncio.gather(
            *(self.history.read(stream, position.offset) for stream, position in wanted),
            return_exceptions=True,
        )
        # Every stream's answer in one write: one system call per client, not per event.
        # Nothing is awaited until it is written, so no live event comes between.
        out: list[Frame] = []
        for (stream, position), history in zip(wanted, reads, strict=True):
            buffered = session.recovering.pop(stream, None)
            if buffered is None:
                continue  # the session stopped watching meanwhile
            self._answer(session, stream, position, history, buffered, out)
        send_frames(session, out, self._outbox_limit)

    def _answer(
        self,
        session: Session,
        stream: str,
        since: Position,
        history: HistoryRead[Broadcast] | BaseException,
        buffered: list[tuple[str, int, Broadcast]],
        out: list[Frame],
    ) -> None:
        recoveries.inc()
        positions = session.positions
        assert positions is not None
        if isinstance(history, BaseException):
            log.warning("history of %s unreadable during recovery: %s", stream, history)
            recoveries_failed.inc()
            epoch, top = (buffered[0][0], buffered[0][1] - 1) if buffered else (since.epoch, 0)
            out.append(Frame(Recovered(stream, False, epoch, top)))
            positions[stream] = (epoch, top)
            self._send_buffered(session, stream, epoch, top, buffered, out)
            return
        plan = merge_recovery(since, history, buffered)
        for offset, message in plan.events:
            self._send_one(session, stream, plan.epoch, offset, message, out)
        if not plan.recovered:
            recoveries_failed.inc()
        if plan.recovered:
            answer = Recovered(stream, True, plan.epoch, plan.offset)
            key = (stream, plan.epoch, plan.offset, "recovered")
            out.append(self._replay_frame(key, lambda: answer))
        else:
            out.append(Frame(Recovered(stream, False, plan.epoch, plan.offset)))
        positions[stream] = (plan.epoch, plan.offset)
        if not plan.recovered:
            self._send_buffered(session, stream, plan.epoch, plan.offset, buffered, out)

    def _send_buffered(
        self,
        session: Session,
        stream: str,
        epoch: str,
        top: int,
        buffered: list[tuple[str, int, Broadcast]],
        out: list[Frame],
    ) -> None:
        for live_epoch, offset, message in buffered:
            if live_epoch == epoch and offset > top:
                self._send_one(session, stream, epoch, offset, message, out)

    def _send_one(
        self,
        session: Session,
        stream: str,
        epoch: str,
        offset: int,
        message: Broadcast,
        out: list[Frame],
    ) -> None:
        assert session.positions is not None
        session.positions[stream] = (epoch, offset)
        if session.user_id in message.exclude:
            key = (stream, epoch, offset, "skip")
            out.append(self._replay_frame(key, lambda: Skip(stream, epoch, offset)))
            return
        event = message.event
        assert isinstance(event, GameEvent | UserEvent)
        key = (stream, epoch, offset, "event")
        out.append(self._replay_frame(key, lambda: Positioned(event, stream, epoch, offset)))

    def _replay_frame(
        self, key: tuple[str, str, int, str], build: Callable[[], ServerMessage]
    ) -> Frame:
        """The frame for ``key`` from the cache, or built and kept: the replay's
        frames are the same for every client that missed the same events."""
        frames = self._replay_frames
        frame = frames.get(key)
        if frame is not None:
            frames.move_to_end(key)
            return frame
        frame = frames[key] = Frame(build())
        if len(frames) > REPLAY_FRAME_CACHE:
            frames.popitem(last=False)
        return frame

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


_KeptState = tuple[dict[str, tuple[str, int]], dict[str, list[tuple[str, int, Broadcast]]]]


def _kept_state(session: Session, streams: set[str] | None) -> _KeptState:
    """A session's stream positions and buffers for ``streams`` (None: all), so
    that re-indexing it (a new watch set, a second subscribe) forgets nothing."""
    positions = session.positions or {}
    return (
        {s: p for s, p in positions.items() if streams is None or s in streams},
        {s: b for s, b in session.recovering.items() if streams is None or s in streams},
    )


def _restore_state(session: Session, kept: _KeptState) -> None:
    positions, recovering = kept
    if session.positions is not None:
        session.positions.update(positions)
    session.recovering.update(recovering)
