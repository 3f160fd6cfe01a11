"""The streams interface: positions, capped history and publish, in one step.

A sibling of the bus (``server/bus/base.py``): the bus carries messages, a
``Streams`` gives each stream event its place first. ``append`` assigns the
stream's next offset, keeps the event in the stream's history and publishes
the positioned message (``protocol.envelope.encode_positioned``) on the bus
topics given, as one atomic step, so every node hears a stream's events in
offset order and no two share an offset. ``read`` returns the position and
what the history still holds; ``read_many`` reads many streams in one round
trip.

Two implementations share one contract suite (``tests/contract/test_streams_contract.py``):
:class:`MemoryStreams` (the embedded default, over a ``MemoryBus``) and
``server.bus.redis_streams.RedisStreams`` (one Lua script per event).

Limits (``Settings``): ``history_size`` events per stream, kept
``history_ttl`` seconds after the stream's last event; the epoch and top live
``stream_meta_ttl`` seconds after the last event, so a client away longer than
the history still learns that it must refetch.

Every append is idempotent: each event has a name (``event_id``). A name
already appended to that stream within its window gets back the position it
took then, and nothing is kept or published again. So a retried append is
harmless: a consumer that died between publishing and recording it, a client
library that resent a pipeline after a dropped connection, a command resent
through a Redis Cluster failover.

Each name is remembered as long as something could bring its event back
(:func:`id_window`), and no longer (it costs Redis about 150-200 bytes):

- a name the server made (:func:`new_event_id`, for an event that arrived
  without one, at the ingress or here for any caller that gave none) can only
  come back through our own retries: ``resend_id_ttl``, 5 minutes, far past
  the longest of them (a Redis Cluster command resent until the failover
  deadline, 10 s, after a stall of 5 s; redis-py's one retry after a 5 s
  socket timeout) and past the retransmissions of a socket closed while its
  bytes were held in a network blackhole (Linux gives an orphaned socket
  about 100 s);
- a notification's name (``notif:<sk>``) as long as the push's own dedup
  (``ap:notif:``, 24 hours, the table stream's retention): a record whose
  push died before it was marked done can be read again that late;
- any other name from outside (an SQS MessageId, a publisher's
  ``Idempotency-Key``, a chat comment's key): ``event_id_ttl``, 15 minutes,
  the queue bridge's dedup window, far past any redelivery (a claim lasts
  twice the visibility timeout).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from protocol.envelope import encode_positioned
from protocol.messages import AdminTest, GameEvent, Position, UserEvent
from protocol.streams import HistoryRead, game_stream, user_stream
from server.bus.memory import MemoryBus
from server.bus.topics import ALL_GAMES, game_topic


@dataclass
class Fence:
    """A lease the appends run under, in the stream's own slot (a game's chat lock).

    The append checks that ``key`` still holds ``token`` and sets ``lost`` if
    not (the event is appended all the same: it is stored already); with
    ``release`` it then drops the lease, in the same step, so the next holder
    can only append after this event. Only streams on Redis look at it: on
    one process the lock is a local one, released by its holder.
    """

    key: str
    token: str
    release: bool = False
    lost: bool = False
    applied: bool = False
    """The append that carried it ran (set by the streams on its reply)."""


class Append(NamedTuple):
    """One event to append to one stream."""

    stream: str
    data: bytes
    """The envelope."""
    topics: Sequence[str]
    """The bus topics to publish it on, positioned."""
    event_id: str | None = None
    """Names the event: appended to this stream once within its window
    (:func:`id_window`); None gets a name of its own before the first attempt."""
    fence: Fence | None = None


def appends_for(
    event: GameEvent | UserEvent | AdminTest, data: bytes, event_id: str | None
) -> list[Append]:
    """Where an event goes: a ``game``/``chat`` event to its game's stream (and to
    legacy clients on ``games``), a user event to each addressed user's stream;
    ``test`` has no stream."""
    if isinstance(event, AdminTest):
        return []
    if isinstance(event, GameEvent):
        topics = (game_topic(event.key), ALL_GAMES)
        return [Append(game_stream(event.key), data, topics, event_id)]
    # Each user stream remembers the id: a retry finds it in every one.
    return [Append(user_stream(u), data, (user_stream(u),), event_id) for u in event.users]


HistoryAsk = tuple[str, int]
"""One history read: (stream, the last offset already known)."""


def new_epoch() -> str:
    """A short random epoch: distinct from every earlier epoch of the stream.

    Redis appends send one with every event (used only when the stream has
    none), so it must be cheap: no system call, unlike ``uuid4``. Not a secret."""
    return f"{random.getrandbits(40):010x}"


@dataclass(frozen=True)
class StreamLimits:
    history_size: int = 50
    history_ttl: float = 900.0
    meta_ttl: float = 24 * 3600.0
    event_id_ttl: float = 900.0
    """How long a name from outside is remembered (the queue bridge's dedup)."""
    notification_id_ttl: float = 24 * 3600.0
    """How long a notification's name is (the notification push's dedup)."""
    resend_id_ttl: float = 300.0
    """How long a name the server made is: past its own retries."""


DEFAULT_LIMITS = StreamLimits()
OWN_NAME = "~"
"""The first character of a name the server made (:func:`new_event_id`); names
from outside never start with it (each ingress prefixes or validates them)."""
NOTIFICATION_NAME = "notif:"
"""The prefix of a notification's name."""


def new_event_id() -> str:
    """A name for an event that arrived without one: unique, cheap, not a secret."""
    return f"{OWN_NAME}{random.getrandbits(96):024x}"


def id_window(limits: StreamLimits, event_id: str) -> float:
    """Seconds an appended ``event_id`` is remembered (module docstring)."""
    if event_id.startswith(OWN_NAME):
        return limits.resend_id_ttl
    if event_id.startswith(NOTIFICATION_NAME):
        return limits.notification_id_ttl
    return limits.event_id_ttl


SWEEP_EVERY = 4096
"""Appends between two sweeps of idle memory streams."""


class Streams(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def append(
        self, stream: str, data: bytes, topics: Sequence[str], event_id: str | None = None
    ) -> Position:
        """Give ``data`` the next position of ``stream``, keep it in the history,
        and publish it positioned on each of ``topics``: one atomic step.

        With ``event_id`` seen on ``stream`` within its window: only return
        the position it took then. Without one, the event is named first."""

    async def append_many(self, items: Sequence[Append]) -> list[Position]:
        """``append`` for each item, in order (pipelined where it can be), each
        under its ``fence`` if it has one (:class:`Fence`)."""

    async def read(self, stream: str, after: int) -> HistoryRead[bytes]:
        """The stream's epoch and top, and its kept events with offsets above
        ``after``. A stream with no epoch gets one here (at top 0), so a client
        told this epoch can later prove it missed nothing."""

    async def read_many(self, asks: Sequence[HistoryAsk]) -> list[HistoryRead[bytes]]:
        """``read`` for each ask, in order, in one round trip where it can be: a
        reconnect storm asks for thousands of histories at once."""


@dataclass
class _MemoryStream:
    epoch: str
    top: int = 0
    last_event: float = 0.0
    history: deque[tuple[int, bytes]] = field(default_factory=deque)
    history_bytes: int = 0

    def forget_history(self) -> None:
        self.history.clear()
        self.history_bytes = 0


class MemoryStreams:
    """The embedded default: one process is the cluster, the loop is the lock."""

    def __init__(
        self,
        bus: MemoryBus,
        limits: StreamLimits = DEFAULT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bus = bus
        self._limits = limits
        self._clock = clock
        self._streams: dict[str, _MemoryStream] = bus.hub.streams
        # (stream, event id) -> (its position, forgotten at): shared on the hub
        # like the streams, as the id keys in Redis are by every node.
        # window -> (stream, event id) -> (its position, forgotten at): one
        # dict per window, so that insertion order is expiry order in each.
        self._event_ids: dict[float, dict[tuple[str, str], tuple[Position, float]]] = (
            bus.hub.event_ids
        )
        self._appends = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def _stream(self, name: str, now: float) -> _MemoryStream:
        state = self._streams.get(name)
        if state is not None and now - state.last_event > self._limits.meta_ttl:
            state = None  # the meta expired: a new epoch, as in Redis
        if state is None:
            state = self._streams[name] = _MemoryStream(epoch=new_epoch(), last_event=now)
        elif now - state.last_event > self._limits.history_ttl:
            state.forget_history()
        return state

    async def append(
        self, stream: str, data: bytes, topics: Sequence[str], event_id: str | None = None
    ) -> Position:
        return self._append(stream, data, topics, event_id)

    def _append(
        self, stream: str, data: bytes, topics: Sequence[str], event_id: str | None
    ) -> Position:
        now = self._clock()
        self._appends += 1
        if self._appends % SWEEP_EVERY == 0:
            self._sweep(now)
        window = 0.0
        if event_id is not None and not event_id.startswith(OWN_NAME):
            # In one process nothing is resent: only names from outside come back.
            window = id_window(self._limits, event_id)
            self._forget_event_ids(now)
            seen = self._event_ids.get(window, {}).get((stream, event_id))
            if seen is not None:
                return seen[0]
        state = self._stream(stream, now)
        state.top += 1
        state.last_event = now
        state.history.append((state.top, data))
        state.history_bytes += len(data)
        while len(state.history) > self._limits.history_size:
            state.history_bytes -= len(state.history.popleft()[1])
        message = encode_positioned(state.epoch, state.top, data)
        for topic in topics:
            self._bus.publish_now(topic, message)
        position = Position(state.epoch, state.top)
        if event_id is not None and window:
            ids = self._event_ids.setdefault(window, {})
            ids[stream, event_id] = (position, now + window)
        return position

    def _forget_event_ids(self, now: float) -> None:
        for ids in self._event_ids.values():
            while ids:
                key = next(iter(ids))
                if ids[key][1] > now:
                    break
                del ids[key]

    async def append_many(self, items: Sequence[Append]) -> list[Position]:
        # the fence is a local lock here, released by its holder
        return [self._append(i.stream, i.data, i.topics, i.event_id) for i in items]

    async def read(self, stream: str, after: int) -> HistoryRead[bytes]:
        state = self._stream(stream, self._clock())
        entries = tuple((o, d) for o, d in state.history if o > after)
        return HistoryRead(state.epoch, state.top, entries)

    async def read_many(self, asks: Sequence[HistoryAsk]) -> list[HistoryRead[bytes]]:
        return [await self.read(stream, after) for stream, after in asks]

    def _sweep(self, now: float) -> None:
        """Forget idle streams (what Redis does with expiring keys)."""
        limits = self._limits
        for name, state in list(self._streams.items()):
            idle = now - state.last_event
            if idle > limits.meta_ttl:
                del self._streams[name]
            elif idle > limits.history_ttl:
                state.forget_history()
        self._forget_event_ids(now)

    def stream_count(self) -> int:
        return len(self._streams)

    def history_bytes(self) -> int:
        """Event bytes the histories hold: the embedded node's part of its memory
        that is a cache by design (at most streams x ``history_size`` events)."""
        return sum(state.history_bytes for state in self._streams.values())
