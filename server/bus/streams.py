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
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from protocol.envelope import encode_positioned
from protocol.messages import Position
from protocol.streams import HistoryRead
from server.bus.memory import MemoryBus

Append = tuple[str, bytes, Sequence[str]]
"""One event to append: (stream, envelope bytes, bus topics to publish it on)."""
HistoryAsk = tuple[str, int]
"""One history read: (stream, the last offset already known)."""


def new_epoch() -> str:
    """A short random epoch: distinct from every earlier epoch of the stream."""
    return uuid.uuid4().hex[:10]


@dataclass(frozen=True)
class StreamLimits:
    history_size: int = 50
    history_ttl: float = 900.0
    meta_ttl: float = 24 * 3600.0


DEFAULT_LIMITS = StreamLimits()
SWEEP_EVERY = 4096
"""Appends between two sweeps of idle memory streams."""


class Streams(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def append(self, stream: str, data: bytes, topics: Sequence[str]) -> Position:
        """Give ``data`` the next position of ``stream``, keep it in the history,
        and publish it positioned on each of ``topics``: one atomic step."""

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
            state.history.clear()
        return state

    async def append(self, stream: str, data: bytes, topics: Sequence[str]) -> Position:
        return self._append(stream, data, topics)

    def _append(self, stream: str, data: bytes, topics: Sequence[str]) -> Position:
        now = self._clock()
        self._appends += 1
        if self._appends % SWEEP_EVERY == 0:
            self._sweep(now)
        state = self._stream(stream, now)
        state.top += 1
        state.last_event = now
        state.history.append((state.top, data))
        while len(state.history) > self._limits.history_size:
            state.history.popleft()
        message = encode_positioned(state.epoch, state.top, data)
        for topic in topics:
            self._bus.publish_now(topic, message)
        return Position(state.epoch, state.top)

    async def append_many(self, items: Sequence[Append]) -> list[Position]:
        return [self._append(stream, data, topics) for stream, data, topics in items]

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
                state.history.clear()

    def stream_count(self) -> int:
        return len(self._streams)
