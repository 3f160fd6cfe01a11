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

Idempotent append: an append may name its event (``event_id``: an SQS
MessageId, a notification row's key). An id already appended to that stream
within ``event_id_ttl`` (15 minutes) gets back the position it took then, and
nothing is kept or published again. This makes a retried append harmless: a
consumer that died between publishing and recording it, or a client library
that resent a script after a dropped connection.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from protocol.envelope import encode_positioned
from protocol.messages import Position
from protocol.streams import HistoryRead
from server.bus.memory import MemoryBus


class Append(NamedTuple):
    """One event to append to one stream."""

    stream: str
    data: bytes
    """The envelope."""
    topics: Sequence[str]
    """The bus topics to publish it on, positioned."""
    event_id: str | None = None
    """Names the event: appended to this stream once within ``event_id_ttl``."""


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
    """How long an appended event id is remembered: longer than any redelivery
    (SQS's visibility timeout, a dedup claim) that could bring the event back."""


DEFAULT_LIMITS = StreamLimits()
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

        With ``event_id`` seen on ``stream`` within ``event_id_ttl``: only return
        the position it took then."""

    async def append_many(self, items: Sequence[Append]) -> list[Position]:
        """``append`` for each item, in order (pipelined where it can be)."""

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
        self._event_ids: dict[tuple[str, str], tuple[Position, float]] = bus.hub.event_ids
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
        if event_id is not None:
            self._forget_event_ids(now)
            seen = self._event_ids.get((stream, event_id))
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
        if event_id is not None:
            self._event_ids[stream, event_id] = (position, now + self._limits.event_id_ttl)
        return position

    def _forget_event_ids(self, now: float) -> None:
        # One ttl for all and a monotonic clock: insertion order is expiry order.
        ids = self._event_ids
        while ids:
            key = next(iter(ids))
            if ids[key][1] > now:
                return
            del ids[key]

    async def append_many(self, items: Sequence[Append]) -> list[Position]:
        return [self._append(*item) for item in items]

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
