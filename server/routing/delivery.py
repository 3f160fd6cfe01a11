"""From the bus to sockets: each stream's events in order, with holes repaired.

Every envelope this node hears comes in through :meth:`StreamDelivery.on_bus_message`.
The node's own appends may be delivered a hop sooner, as their positions come back
(:meth:`StreamDelivery.deliver_appended`); the bus's copy then finds them delivered.
A positioned event is checked against the node's cursor for its stream: the
next one is delivered at once; one beyond the next starts a repair, which
reads the hole from history and then delivers what arrived meanwhile, in
order; when the history cannot fill it, or the epoch changed, the stream's
speakers are told ``recovered: false`` and refetch. Presence deltas and hints
go to the node's presence; ``test`` goes to every subscribed session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Coroutine, Iterable
from typing import Any, Protocol

from protocol.codec import Frame
from protocol.envelope import (
    EnvelopeError,
    PositionedData,
    PresenceHint,
    decode_envelope,
    decode_positioned,
    is_positioned,
)
from protocol.messages import (
    AdminTest,
    Broadcast,
    GameEvent,
    Position,
    Positioned,
    PresenceDelta,
    Recovered,
    Skip,
    UserEvent,
)
from protocol.streams import (
    HistoryRead,
    Step,
    StreamCursor,
    already_sent,
    game_stream,
    stream_user,
    unannounced,
)
from server.bus.topics import ALL_GAMES, PRESENCE, PRESENCE_HINTS, game_topic
from server.routing.history_reads import HistoryReads
from server.routing.index import HubIndex
from server.runtime.metrics import Registry
from server.session import Session, send_frame

log = logging.getLogger(__name__)


class DeliveryCounters:
    """The delivery's counters, on its node's registry."""

    def __init__(self, registry: Registry) -> None:
        counter = registry.counter
        self.events_received = counter("ap_bus_messages_total", "Envelopes received from the bus")
        self.bad_envelopes = counter(
            "ap_bus_bad_envelopes_total", "Envelopes that failed to decode"
        )
        self.stream_gaps = counter(
            "ap_stream_gaps_total",
            "Holes in a stream this node heard, repaired from history or not",
        )
        self.stream_losses = counter(
            "ap_stream_losses_total",
            "Times this node told its clients recovered:false for a stream",
        )
        self.stream_repaired = counter(
            "ap_stream_repaired_events_total",
            "Events this node missed live and delivered from history",
        )
        self.delivered_at_append = counter(
            "ap_stream_delivered_at_append_total",
            "This node's own events delivered as their append answered, before the bus's copy",
        )


class PresenceFeed(Protocol):
    """Where the presence envelopes heard on the bus go."""

    def delta(self, delta: PresenceDelta) -> None: ...

    def hint(self, user_ids: Iterable[str], changed_at: float | None) -> None: ...


AfterLoss = Callable[[Session], Coroutine[Any, Any, None]]
"""Run for a bot session told ``recovered: false`` on its user stream (its turns afresh)."""


class StreamDelivery:
    def __init__(
        self,
        index: HubIndex,
        history: HistoryReads,
        presence: PresenceFeed,
        after_loss: AfterLoss,
        outbox_limit: int,
        metrics: Registry,
    ) -> None:
        self._counts = DeliveryCounters(metrics)
        self._index = index
        self._history = history
        self._presence = presence
        self._after_loss = after_loss
        self._outbox_limit = outbox_limit
        self.cursors: dict[str, StreamCursor] = {}
        # Streams whose hole is being filled from history -> events that arrived meanwhile.
        self._repairing: dict[str, list[tuple[PositionedData, Broadcast]]] = {}
        self._background: set[asyncio.Task[None]] = set()

    def forget(self, stream: str) -> None:
        """Nobody here holds the stream any more: its cursor would only go stale."""
        self.cursors.pop(stream, None)

    def cancel(self) -> None:
        """Stop every repair and follow-up still running."""
        for task in list(self._background):
            task.cancel()

    def on_bus_message(self, topic: str, data: bytes) -> None:
        self._counts.events_received.inc()
        try:
            if is_positioned(data):
                positioned = decode_positioned(data)
                cursor = self.cursors.get(topic)
                if (
                    cursor is not None
                    and cursor.step(positioned.epoch, positioned.offset) is Step.DUPLICATE
                ):
                    return  # delivered already (mostly: this node's own, at its append)
                envelope = decode_envelope(positioned.data)
                if isinstance(envelope, Broadcast):
                    self._on_stream_event(topic, positioned, envelope)
                return
            envelope = decode_envelope(data)
        except EnvelopeError as exc:
            self._counts.bad_envelopes.inc()
            log.warning("dropped envelope on %s: %s", topic, exc)
            return
        if isinstance(envelope, Broadcast):
            if isinstance(envelope.event, AdminTest):
                self._route_admin(envelope)
        elif isinstance(envelope, PresenceDelta) and topic == PRESENCE:
            self._presence.delta(envelope)
        elif isinstance(envelope, PresenceHint) and topic == PRESENCE_HINTS:
            self._presence.hint(envelope.user_ids, envelope.changed_at)

    def deliver_unpositioned(self, stream: str, message: Broadcast) -> None:
        """The event as it was, for this node's clients only: Redis gave it no position."""
        event = message.event
        legacy = self._index.legacy
        recipients = _not_excluded(self._index.recipients(stream), message.exclude)
        if isinstance(event, GameEvent) and legacy:
            recipients = [*recipients, *_not_excluded(legacy, message.exclude)]
        if recipients:
            send_frame(recipients, Frame(event), self._outbox_limit)

    def deliver_appended(self, stream: str, position: Position, message: Broadcast) -> None:
        """This node appended ``message`` and Redis answered its position: deliver it
        now when it is the very next event of a stream this node tracks, rather than
        when the bus's copy arrives (a read later). Anything else is left to the bus,
        which brings a stream's events in order: an earlier event of another node may
        still be on its way, and a new epoch or a repair goes through history."""
        cursor = self.cursors.get(stream)
        if (
            cursor is None
            or stream in self._repairing
            or not cursor.take_next(position.epoch, position.offset)
        ):
            return
        self._counts.delivered_at_append.inc()
        self._deliver(stream, position.epoch, position.offset, message)

    def check_streams(self) -> None:
        """The bus reconnected: events of any held stream may have been lost
        meanwhile (or Redis restarted without its data), so compare each cursor
        with its stream's history and repair."""
        for stream in list(self.cursors):
            self.check(stream)

    def hold(self, stream: str, epoch: str, top: int) -> None:
        """A recovery told a tab here that ``stream`` is at ``(epoch, top)``. The
        node tracks the stream from there like one it delivered live, so that a
        later reconnect checks it and a new epoch or a hole is announced to the
        tab, never passed on in silence. History ahead of the cursor means this
        node missed events: they are read now."""
        cursor = self.cursors.get(stream)
        if cursor is None:
            if self._index.holds(stream):
                self.cursors[stream] = StreamCursor(epoch, top)
        elif cursor.epoch != epoch or cursor.offset < top:
            self.check(stream)

    def repairing(self, stream: str) -> bool:
        """Whether a check of ``stream`` is under way."""
        return stream in self._repairing

    def check(self, stream: str) -> None:
        """Compare ``stream``'s cursor with its history and deliver what is missing
        (once: a check already under way covers this one)."""
        if stream not in self._repairing:
            self._repairing[stream] = []
            self._spawn(self._repair(stream), f"check {stream}")

    def _route_admin(self, message: Broadcast) -> None:
        recipients: list[Session] = [s for s in self._index.sessions if s.subscribed]
        if message.exclude:
            recipients = [s for s in recipients if s.user_id not in message.exclude]
        if recipients:
            send_frame(recipients, Frame(message.event), self._outbox_limit)

    def _on_stream_event(self, topic: str, positioned: PositionedData, message: Broadcast) -> None:
        event = message.event
        if topic == ALL_GAMES:
            # Legacy clients: every game event, positioned but never tracked.
            legacy = self._index.legacy
            if isinstance(event, GameEvent) and legacy:
                frame = Frame(
                    Positioned(event, game_stream(event.key), positioned.epoch, positioned.offset)
                )
                recipients = _not_excluded(legacy, message.exclude)
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
            if not self._index.holds(stream):
                return  # a message in flight after the last watcher left
            cursor = self.cursors[stream] = StreamCursor()
        arrival = cursor.receive(epoch, offset, repairing=repairing)
        if arrival.step is Step.GAP and not repairing:
            # Once per hole: one its repair could not fill comes back here as GAP.
            self._counts.stream_gaps.inc()
        if arrival.repair:
            self._repairing[stream] = [(positioned, message)]
            self._spawn(self._repair(stream), f"repair {stream}")
            return
        if arrival.lost is not None:
            # The history could not fill the hole, or the epoch changed: the watchers must refetch.
            self._lost(stream, arrival.lost.epoch, arrival.lost.offset)
        if arrival.deliver:
            self._deliver(stream, epoch, offset, message)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _repair(self, stream: str) -> None:
        """Fill a hole from history, then deliver what arrived meanwhile, in order."""
        cursor = self.cursors.get(stream)
        history: HistoryRead[Broadcast] | None = None
        if cursor is not None:
            history = await self._history.read_patiently(stream, cursor.offset)
            if history is not None and history.epoch != cursor.epoch and cursor.offset > 0:
                # A new epoch: its events from the first one, not past the old top.
                history = await self._history.read_patiently(stream, 0)
        pending = self._repairing.pop(stream, [])
        cursor = self.cursors.get(stream)
        if cursor is None:
            return  # nobody here holds the stream any more
        if history is not None:
            repair = cursor.fill(history)
            if repair.lost is not None:
                self._lost(stream, repair.lost.epoch, repair.lost.offset)
            for offset, envelope in repair.events:
                self._counts.stream_repaired.inc()
                self._deliver(stream, history.epoch, offset, envelope)
        # Arrival order is stream order (Redis publishes a stream's events in order).
        for positioned, message in pending:
            self._step(stream, positioned, message, repairing=True)

    def _deliver(self, stream: str, epoch: str, offset: int, message: Broadcast) -> None:
        recipients = self._index.recipients(stream)
        if not recipients:
            return
        event = message.event
        assert isinstance(event, GameEvent | UserEvent)
        frame = Frame(Positioned(event, stream, epoch, offset))
        speakers = self._index.speakers.get(stream)
        if speakers is None:
            # The fast path: nobody here speaks streams on this one.
            send_frame(_not_excluded(recipients, message.exclude), frame, self._outbox_limit)
            return
        plain = recipients - speakers
        if plain:
            send_frame(_not_excluded(plain, message.exclude), frame, self._outbox_limit)
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
            if already_sent(last, epoch, offset):
                continue  # sent by its replay
            if unannounced(last, epoch, offset):
                # Never past what this tab was told without notice (its position
                # came from somewhere this node's cursor did not see).
                self._tell_lost(session, stream, Frame(Recovered(stream, False, epoch, offset - 1)))
            positions[stream] = (epoch, offset)
            (skips if session.user_id in exclude else sends).append(session)
        if sends:
            send_frame(sends, frame, self._outbox_limit)
        if skips:
            send_frame(skips, Frame(Skip(stream, epoch, offset)), self._outbox_limit)

    def _lost(self, stream: str, epoch: str, top: int) -> None:
        """This node cannot prove continuity on ``stream``: its speakers must refetch."""
        frame = Frame(Recovered(stream, False, epoch, top))
        for session in self._index.speakers.get(stream, ()):
            if stream in session.recovering:
                continue  # its own recovery sees the same hole in its buffer
            assert session.positions is not None
            session.positions[stream] = (epoch, top)
            self._tell_lost(session, stream, frame)

    def _tell_lost(self, session: Session, stream: str, frame: Frame) -> None:
        self._counts.stream_losses.inc()
        session.send(frame, self._outbox_limit)
        if session.is_bot and stream_user(stream) is not None:
            # Turns may be among what was lost: the bot gets its list afresh.
            self._spawn(self._after_loss(session), "pendingTurns")


def _not_excluded(sessions: Collection[Session], exclude: frozenset[str]) -> Collection[Session]:
    if not exclude:
        return sessions
    return [s for s in sessions if s.user_id not in exclude]
