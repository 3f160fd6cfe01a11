"""The hub's indexes: who on this node hears what, kept up to date on subscribe and watch.

Every event finds its recipients here without a scan of all connections:
``by_user`` for user streams, ``by_game`` for game streams, ``legacy`` for
clients that hear every game. ``speakers`` are the stream-speaking sessions
among a stream's recipients (the rest share one frame per event). The first
holder of a user or a game subscribes this node to its topic, the last one
unsubscribes it, through one coalescing flusher.

Admission caps live here too, since they are counts over these indexes.
"""

from __future__ import annotations

from collections.abc import Callable

from protocol.errors import CloseCode, ErrorCode
from protocol.messages import Broadcast, GameKey
from protocol.streams import game_stream, stream_game, stream_user, user_stream
from server.bus.base import Bus
from server.bus.topics import ALL_GAMES, game_topic
from server.config import Settings
from server.runtime.metrics import REGISTRY
from server.runtime.write_behind import CoalescingFlusher
from server.session import Session

bus_failures = REGISTRY.counter(
    "ap_bus_subscription_retries_total", "Bus subscription changes that failed and were retried"
)


class HubIndex:
    """This node's sessions and the indexes that route events to them."""

    def __init__(self, settings: Settings, bus: Bus, released: Callable[[str], None]) -> None:
        """``released`` is told of a stream nobody on this node holds any more."""
        self._settings = settings
        self._bus = bus
        self._released = released
        self._outbox_limit = settings.outbox_limit_bytes
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
        self.topics: CoalescingFlusher[str, bool] = CoalescingFlusher(
            "bus-topics", self._apply_topics, lambda _old, new: new, bus_failures
        )
        REGISTRY.gauge("ap_connections", "Open WebSocket sessions", lambda: len(self.sessions))
        REGISTRY.gauge("ap_watched_games", "Games watched on this node", lambda: len(self.by_game))

    # --- admission ------------------------------------------------------------

    def admit_user(self, session: Session, user_id: str) -> bool:
        """At most --max-connections-per-user sockets per user: each pins memory."""
        cap = self._settings.max_connections_per_user
        if len(self.by_user.get(user_id, ())) < cap:
            return True
        session.send_error(
            ErrorCode.TOO_MANY_CONNECTIONS,
            f"this user already has {cap} connections open",
            self._outbox_limit,
        )
        session.close(CloseCode.TOO_MANY_CONNECTIONS, "too many connections")
        return False

    def games_allowed(
        self, session: Session, user_id: str, games: frozenset[GameKey], replacing: int = 0
    ) -> bool:
        """At most --max-watched-games-per-user keys over all of a user's sockets
        (``replacing``: keys of this session's that ``games`` replaces)."""
        cap = self._settings.max_watched_games_per_user
        held = self.games_by_user.get(user_id, 0) - replacing
        if held + len(games) <= cap:
            return True
        session.send_error(
            ErrorCode.TOO_MANY_GAMES,
            f"this user may watch at most {cap} games over all connections",
            self._outbox_limit,
        )
        return False

    # --- lookups --------------------------------------------------------------

    def holds(self, stream: str) -> bool:
        """Whether any session on this node hears ``stream``."""
        game = stream_game(stream)
        if game is not None:
            return game in self.by_game
        user = stream_user(stream)
        return user is not None and user in self.by_user

    def recipients(self, stream: str) -> set[Session]:
        game = stream_game(stream)
        if game is not None:
            return self.by_game.get(game, set())
        user = stream_user(stream)
        return self.by_user.get(user, set()) if user is not None else set()

    # --- changes --------------------------------------------------------------

    def add(self, session: Session) -> None:
        """Index a subscribed session: its user, its presence wish, its games."""
        assert session.user_id is not None
        tabs = self.by_user.get(session.user_id)
        if tabs is None:
            tabs = self.by_user[session.user_id] = set()
            # Per-user channels: this node hears only the users it holds.
            self.topics.put(user_stream(session.user_id), True)
        tabs.add(session)
        if session.speaks_streams:
            self._add_speaker(user_stream(session.user_id), session)
        if session.wants_presence:
            self.presence_watchers.add(session)
        if session.heartbeat:
            self.heartbeats.add(session)
        self.add_games(session)

    def remove(self, session: Session) -> None:
        assert session.user_id is not None
        stream = user_stream(session.user_id)
        users = self.by_user.get(session.user_id)
        if users is not None:
            users.discard(session)
            if not users:
                del self.by_user[session.user_id]
                self.topics.put(stream, False)
                self._released(stream)
        self._drop_speaker(stream, session)
        self.presence_watchers.discard(session)
        self.heartbeats.discard(session)
        self.remove_games(session)

    def add_games(self, session: Session) -> None:
        if session.watching:
            assert session.user_id is not None
            user_id = session.user_id
            self.games_by_user[user_id] = self.games_by_user.get(user_id, 0) + len(session.watching)
        if session.legacy:
            if not self.legacy:
                self.topics.put(ALL_GAMES, True)
            self.legacy.add(session)
            return
        speaks = session.speaks_streams
        for key in session.watching:
            watchers = self.by_game.get(key)
            if watchers is None:
                watchers = self.by_game[key] = set()
                self.topics.put(game_topic(key), True)
            watchers.add(session)
            if speaks:
                self._add_speaker(game_stream(key), session)

    def remove_games(self, session: Session) -> None:
        if session.watching and session.user_id is not None:
            left = self.games_by_user.get(session.user_id, 0) - len(session.watching)
            if left > 0:
                self.games_by_user[session.user_id] = left
            else:
                self.games_by_user.pop(session.user_id, None)
        if session in self.legacy:
            self.legacy.discard(session)
            if not self.legacy:
                self.topics.put(ALL_GAMES, False)
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
                self.topics.put(game_topic(key), False)
                self._released(stream)

    def rewatch(self, session: Session, games: frozenset[GameKey], *, speaks_streams: bool) -> None:
        """Re-index ``session`` under the watch set ``games``; the stream positions and
        buffers of the games it keeps stay. ``speaks_streams``: it asked with ``since``."""
        kept = kept_stream_state(session, {game_stream(key) for key in games & session.watching})
        self.remove_games(session)
        if speaks_streams and session.positions is None:
            session.positions = {}
        session.watching = games
        session.watch_version = 1
        self.add_games(session)
        restore_stream_state(session, kept)

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

    async def _apply_topics(self, batch: dict[str, bool]) -> dict[str, bool]:
        wanted = [topic for topic, on in batch.items() if on]
        unwanted = [topic for topic, on in batch.items() if not on]
        if wanted:
            await self._bus.subscribe(wanted)
        if unwanted:
            await self._bus.unsubscribe(unwanted)
        return {}


StreamState = tuple[dict[str, tuple[str, int]], dict[str, list[tuple[str, int, Broadcast]]]]


def kept_stream_state(session: Session, streams: set[str] | None) -> StreamState:
    """A session's stream positions and buffers for ``streams`` (None: all), so
    that re-indexing it (a new watch set, a second subscribe) forgets nothing."""
    positions = session.positions or {}
    return (
        {s: p for s, p in positions.items() if streams is None or s in streams},
        {s: b for s, b in session.recovering.items() if streams is None or s in streams},
    )


def restore_stream_state(session: Session, kept: StreamState) -> None:
    if session.positions is not None:
        session.positions.update(kept[0])
    session.recovering.update(kept[1])
