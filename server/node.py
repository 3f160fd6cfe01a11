"""The hub's interface: sessions in and out, ``publish``, ``status()``, and its life.

Every event enters the cluster once, through :meth:`Node.publish` (``game`` and ``chat``
go to the game's stream, a ``UserEvent`` to each addressed user's stream, ``test`` to
every node), crosses the bus, and each node picks its own recipients from indexes kept up
to date on subscribe and watch. The rooms behind it: ``routing/`` (indexes, delivery in
stream order, recovery), ``presence/node_presence.py`` (this node's part in presence),
``services/`` (domain rules, given callables, never the node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

from protocol.envelope import encode_envelope
from protocol.errors import CloseCode, ErrorCode
from protocol.messages import AdminTest, Broadcast, GameKey, Position, Since, Subscribe
from server.auth.verify import Authenticator, AuthError, AuthUnavailable
from server.bus.base import Bus
from server.bus.streams import Fence, Streams, appends_for
from server.bus.topics import ADMIN, NODE_TOPICS
from server.config import Settings
from server.presence.core import PresenceBackend
from server.presence.node_presence import NodePresence
from server.routing.delivery import StreamDelivery
from server.routing.heartbeats import send_heartbeats
from server.routing.history_reads import HistoryReads
from server.routing.index import HubIndex, StreamState, kept_stream_state, restore_stream_state
from server.routing.keepalive import keep_alive
from server.routing.recovery import Recovery
from server.routing.subscribe_batching import SubscribeBatcher
from server.runtime.connection_rows import ConnectionRegistry
from server.runtime.metrics import Registry
from server.runtime.pacer import Pacer
from server.runtime.tasks import run_until_unwound
from server.runtime.write_behind import drained_within
from server.services import Coordination, Service
from server.services.bots import BotService
from server.services.chat import ChatService
from server.services.chat_marks import ChatMarks
from server.services.last_seen import LastSeen
from server.session import Session, Traffic, close_spread_out, wait_closed
from server.store.base import Store, ttl_from_now

log = logging.getLogger(__name__)

WRITES_GRACE_S = 2.0
"""How long a stop waits for queued marks and lastSeen writes to reach the store."""


class Node:
    """One node's hub: its sessions, their indexes, and the rooms that serve them."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        bus: Bus,
        presence_backend: PresenceBackend,
        authenticator: Authenticator,
        streams: Streams,
        coordination: Coordination,
        *,
        metrics: Registry | None = None,
    ) -> None:
        """The node's parts come chosen (``server.wiring``); it composes its rooms, each
        counting on ``metrics``, this node's own registry (``/metrics`` reads it)."""
        self.settings = settings
        self.metrics = metrics = metrics if metrics is not None else Registry()
        self.traffic = Traffic(metrics, settings.write_delay_ms / 1000)
        count = metrics.counter
        self._published = count("ap_events_published_total", "Events accepted for fan-out")
        self.node_id = settings.node_id
        self.store = store
        self.bus = bus
        self.presence_backend = presence_backend
        self.authenticator = authenticator
        self.streams = streams
        self._outbox_limit = limit = settings.outbox_limit_bytes
        # One pacer for all background writers: they take turns behind delivery.
        self.registry = ConnectionRegistry(store, metrics, pacer := Pacer())
        self.index = HubIndex(settings, bus, lambda stream: self.delivery.forget(stream), metrics)
        self.sessions = self.index.sessions
        self.last_seen = LastSeen(store, coordination.last_seen_claims, metrics, pacer)
        watchers = self.index.presence_watchers
        self.presence = NodePresence(
            settings, presence_backend, store, self.sessions, watchers, self.last_seen.seen, metrics
        )
        self.bots = BotService(
            store,
            settings.bot_max_connections,
            limit,
            subscribe=bus.subscribe,
            watch=self.watch,
            is_open=self.sessions.__contains__,
            metrics=metrics,
            sessions=coordination.bot_sessions,
        )
        # Every history read (recovery, repair) goes out in batches.
        self.history = HistoryReads(
            streams, patience=settings.history_patience_seconds, metrics=metrics
        )
        self.delivery = StreamDelivery(
            self.index, self.history, self.presence, self.bots.send_pending_turns, limit, metrics
        )
        hold = self.delivery.hold  # a recovery's answer is a stream this node now holds
        self.recovery = Recovery(self.history, SubscribeBatcher(bus), limit, metrics, hold)
        self.chat_marks = ChatMarks(store, metrics)
        self.chat = ChatService(
            store,
            self.publish,
            coordination.game_locks,
            coordination.chat_limiter,
            self.chat_marks,
            limit,
            metrics=metrics,
        )
        self.services: list[Service] = []  # started after the node, stopped before it
        self.ready = False
        self.draining = False
        self._sessions_gone = asyncio.Event()  # set when a drain has closed the last one
        self._running = AsyncExitStack()  # the stops of what started, for ``stop``

    # --- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Start every part in order, then be ready. Each part's stop goes on one
        ``AsyncExitStack`` just before the part starts (a start that fails half-way
        closes exactly what started, in reverse order); ``stop`` unwinds the same stack."""
        async with AsyncExitStack() as stack:
            await self._start(stack)
            self._running = stack.pop_all()
        self.ready = True

    async def _start(self, stack: AsyncExitStack) -> None:
        limit = self._outbox_limit
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
        stack.push_async_callback(drained_within, WRITES_GRACE_S, self.chat_marks, self.last_seen)
        await self.presence.start(stack)
        ttl_refresh = self.registry.keep_alive(self.sessions, self.settings.ttl_refresh_seconds)
        run_until_unwound(stack, ttl_refresh, "ttl-refresh")
        beat = self.settings.heartbeat_seconds
        run_until_unwound(stack, send_heartbeats(self.index.heartbeats, beat, limit), "heartbeats")
        pings = keep_alive(self.sessions, self.settings.ping_interval, self.settings.ping_timeout)
        run_until_unwound(stack, pings, "keepalive")
        self.bots.start(stack)  # its marks are dropped after the sessions closed
        stack.push_async_callback(self._close_sessions)
        for service in self.services:
            stack.push_async_callback(_stop_service, service)
            await service.start()

    async def drain(self, seconds: float) -> int:
        """Close every session with 1012, spread over ``seconds`` in jittered batches;
        returns how many it closed (all at once would send every client elsewhere in one
        second). Each closed user stays reported by this node until its own connection is
        gone, so one who reconnects elsewhere is never offline in the cluster's view (the
        writer's debounce absorbs the move). The caller has stopped the listener;
        ``/readyz`` answers 503 from here on."""
        self.ready = False
        self.draining = True
        sessions = list(self.sessions)
        if not sessions:
            return 0
        loop = asyncio.get_running_loop()
        started = loop.time()
        await close_spread_out(sessions, seconds, CloseCode.SERVICE_RESTART, "server restarting")
        for session in list(self.sessions):  # any that slipped in while the listener closed
            session.close(CloseCode.SERVICE_RESTART, "server restarting")
        await wait_closed(sessions, self.settings.close_timeout)
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
        await wait_closed(sessions, 5)

    async def _delete_rows(self) -> None:
        with contextlib.suppress(Exception):
            await self.store.delete_endpoint_connections(self.node_id)

    # --- status ---------------------------------------------------------------

    def readiness(self) -> dict[str, bool]:
        """What ``/readyz`` checks: started and not draining, and the bus serving."""
        return {"started": self.ready, "bus": self.bus.serving}

    async def status(self) -> dict[str, Any]:
        """This node now, for the operator's page (which adds its settings and counters)."""
        return {
            "node": self.node_id,
            "ready": self.ready,
            "draining": self.draining,
            "connections": len(self.sessions),
            "users": self.presence.local.user_count,
            "watched_games": len(self.index.by_game),
            "presence": self.presence.status(),
            "bus_connected": self.bus.connected,
            "nodes": await self.presence.members(),
        }

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
            return self.bots.left(session)  # bots are not in presence: only their marks
        if self.draining:
            self.presence.left_for_another_node(user_id, session.invisible)
        else:
            self.presence.left(user_id, session.invisible)

    async def subscribe(self, session: Session, action: Subscribe) -> bool:
        """Apply a subscribe; False when it was refused (its error frame is sent)."""
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
            session, identity.user_id, lambda: self.index.by_user.get(identity.user_id, ())
        ):
            return False
        if session not in self.sessions:
            return False  # closed while the token was checked
        kept: StreamState = ({}, {})
        if session.subscribed:
            if session.user_id != identity.user_id:
                session.send_error(
                    ErrorCode.USER_MISMATCH,
                    "this connection is subscribed as another user",
                    self._outbox_limit,
                )
                return False
            kept = kept_stream_state(session, None)
            self.index.remove(session)
            if not session.is_bot:
                # Reported together with the join below, as one change.
                self.presence.local.remove(identity.user_id, session.invisible)
        elif not self.index.admit_user(session, identity.user_id):
            return False
        games = action.games if action.games is not None else frozenset()
        if not self.index.games_allowed(session, identity.user_id, games):
            games = frozenset()
        session.take_subscribe(identity.user_id, identity.kind, action, games)
        self.index.add(session)
        restore_stream_state(session, kept)
        if not bot:
            self.presence.joined(identity.user_id, session.invisible)
        self.registry.put(session.row(self.node_id))
        self.last_seen.seen(identity.user_id)
        if session.wants_presence:
            # The snapshot and this session's place among delta recipients are
            # taken in the same loop turn, so it misses no delta after the snapshot.
            self.presence.send_snapshot(session)
        if action.since is not None:
            await self.recovery.recover(session, action.since)
        if bot:
            # After recovery: a recovered:false is followed by a fresh list.
            await self.bots.send_pending_turns(session)
        return session in self.sessions and session.close_task is None

    async def watch(
        self, session: Session, games: frozenset[GameKey], since: Since | None = None
    ) -> bool:
        """Replace the watch set; False when it was refused (the old set stays)."""
        assert session.user_id is not None
        if not self.index.games_allowed(session, session.user_id, games, len(session.watching)):
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
            self.index.rewatch(session, games, speaks_streams=since is not None)
            session.row_ttl = ttl_from_now()
            self.registry.watch(session.connection_id, games, 1, session.row_ttl)
        if since is not None:
            await self.recovery.recover(session, since)
        return True

    def sync_presence(self, session: Session) -> None:
        self.presence.sync(session)

    # --- events -------------------------------------------------------------

    async def publish(
        self,
        message: Broadcast,
        *,
        require_cluster: bool = False,
        event_id: str | None = None,
        then: Sequence[tuple[Broadcast, str]] = (),
        fence: Fence | None = None,
    ) -> dict[str, Position]:
        """The one door into the cluster for every event; the positions it took. Each event
        goes where ``appends_for`` says (``test``: the admin topic). With the bus down it is
        delivered on this node only, unpositioned (``require_cluster``: it raises, for the
        caller to retry). ``event_id`` names it: a repeat answers the first position.
        ``then``: named events appended right after, in the same round trip, the last
        under ``fence`` (a chat post's hint and its lock's release)."""
        self._published.inc(1 + len(then))
        data = encode_envelope(message)
        if isinstance(message.event, AdminTest):
            await self.bus.publish(ADMIN, data, local_fallback=not require_cluster)
            return {}
        events = [(message, data, event_id), *((m, encode_envelope(m), n) for m, n in then)]
        pairs = [(m, item) for m, d, n in events for item in appends_for(m.event, d, n)]
        items = [item for _, item in pairs]
        if fence is not None:
            items[-1] = items[-1]._replace(fence=fence)
        try:
            positions = await self.streams.append_many(items)
        except Exception:
            if self.bus.connected or require_cluster:
                raise
            # Redis is away: nobody can assign positions, but this node's own
            # clients still hear of the event (they are told to refetch later).
            log.warning("streams unreachable: %s delivered on this node only", message.event.verb)
            for m, item in pairs:
                self.delivery.deliver_unpositioned(item.stream, m)
            return {}
        deliver = self.delivery.deliver_appended
        answer: dict[str, Position] = {}
        for (m, item), position in zip(pairs, positions, strict=True):
            deliver(item.stream, position, m)
            if m is message:
                answer[item.stream] = position
        return answer


async def _stop_service(service: Service) -> None:
    try:
        await service.stop()
    except Exception:
        log.exception("stopping %s failed", type(service).__name__)
