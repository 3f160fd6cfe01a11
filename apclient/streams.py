"""Stream positions, recovery answers, duplicates, gaps and coalesced replays: no I/O.

Two positions per stream:

- *received*: the last event handed to the application (queued for its
  handlers). Duplicates and gaps are judged against it, and it is what a
  reconnect sends as ``since``: the events behind it are already in hand.
- *committed*: the last position every handler has finished with, in stream
  order (:class:`Commits`). Only this one is stored, so a process that dies
  mid-handler replays what it had not finished.

:class:`Tracker` turns server frames into :data:`Output` values; the asyncio
layer hands them to the handlers and reports back when they are done.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from apclient.events import Event, RecoveryInfo, ResyncInfo, ResyncReason
from apclient.storage import MAX_STREAMS
from protocol.messages import Position, Positioned, Recovered, Skip


@dataclass(frozen=True, slots=True)
class StreamFrame:
    """A positioned frame: an event, or a ``skip`` (an event this user is excluded from)."""

    verb: str
    payload: Any
    stream: str
    epoch: str
    offset: int

    @classmethod
    def of(cls, message: Positioned | Skip) -> StreamFrame:
        if isinstance(message, Skip):
            return cls("skip", None, message.stream, message.epoch, message.offset)
        event = message.event
        return cls(event.verb, event.payload, message.stream, message.epoch, message.offset)

    @property
    def position(self) -> Position:
        return Position(self.epoch, self.offset)


class Verdict(Enum):
    FIRST = "first"  # no position yet: take it
    NEXT = "next"
    OLD = "old"  # at or below the position: a duplicate, dropped
    GAP = "gap"  # offsets missing: resync, then take it
    EPOCH = "epoch"  # the stream lost its history: resync, then take it


def judge(last: Position | None, epoch: str, offset: int) -> Verdict:
    """How an event at (``epoch``, ``offset``) follows the position ``last``."""
    if last is None or last.epoch == "":
        return Verdict.FIRST
    if epoch != last.epoch:
        return Verdict.EPOCH
    if offset <= last.offset:
        return Verdict.OLD
    return Verdict.NEXT if offset == last.offset + 1 else Verdict.GAP


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand ``event`` to the handlers; once they are done, ``stream`` is at ``commit``."""

    event: Event
    commit: Position


@dataclass(frozen=True, slots=True)
class Resync:
    """Call the application's resync; then the stream is at ``commit`` (None: the
    event that follows commits)."""

    info: ResyncInfo
    commit: Position | None


@dataclass(frozen=True, slots=True)
class Report:
    """A ``recovered`` answer for the application; the stream is at ``commit``
    (None: the resync before it commits)."""

    info: RecoveryInfo
    commit: Position | None


@dataclass(frozen=True, slots=True)
class Advance:
    """Nothing to hand over (skips): the stream is at ``commit`` once what came before is."""

    stream: str
    commit: Position


Output = Deliver | Resync | Report | Advance


@dataclass
class _Recovery:
    was: bool  # a real position was sent
    replayed: int = 0
    held: list[StreamFrame] = field(default_factory=list)  # a coalesced burst (and its skips)


class Tracker:
    """Follows every stream of one client across its connections.

    ``begin`` names the streams a subscribe or watchGames is about to recover;
    their frames count as replayed until their ``recovered`` answer. Replayed
    frames of a verb in ``coalesce`` are held and handed over as one event per
    burst (a different verb, the answer, or the end of the socket ends it).
    """

    def __init__(self, positions: Mapping[str, Position], coalesce: Iterable[str] = ()) -> None:
        self.received: OrderedDict[str, Position] = OrderedDict(positions)
        self.coalesce = frozenset(coalesce)
        self._recovering: dict[str, _Recovery] = {}

    def position(self, stream: str) -> Position | None:
        return self.received.get(stream)

    def recovering(self, stream: str) -> bool:
        return stream in self._recovering

    def begin(self, streams: Iterable[str]) -> dict[str, Position]:
        """The ``since`` to send for ``streams``, which are recovering from now on."""
        since: dict[str, Position] = {}
        for stream in streams:
            known = self.received.get(stream)
            since[stream] = known if known is not None else Position("", 0)
            self._recovering[stream] = _Recovery(was=bool(known is not None and known.epoch))
        return since

    def drop(self, streams: Iterable[str]) -> list[Output]:
        """The action naming ``streams`` was refused: no answer is coming for them."""
        out: list[Output] = []
        for stream in streams:
            self._flush(stream, self._recovering.pop(stream, None), out)
        return out

    def reset(self) -> list[Output]:
        """The socket is gone: hand over what is held, forget what was recovering."""
        return self.drop(list(self._recovering))

    def frame(self, frame: StreamFrame) -> list[Output]:
        stream = frame.stream
        recovery = self._recovering.get(stream)
        held = recovery.held if recovery is not None else []
        last = held[-1].position if held else self.received.get(stream)
        verdict = judge(last, frame.epoch, frame.offset)
        if verdict is Verdict.OLD:
            return []
        out: list[Output] = []
        skip = frame.verb == "skip"
        if recovery is not None and not skip:
            recovery.replayed += 1
        if verdict is Verdict.GAP or verdict is Verdict.EPOCH:
            self._flush(stream, recovery, out)
            reason: ResyncReason = "gap" if verdict is Verdict.GAP else "epoch"
            info = ResyncInfo(stream, reason, frame.epoch, frame.offset)
            out.append(Resync(info, None))
        if recovery is not None and (held if skip else frame.verb in self.coalesce):
            if held and not skip and held[0].verb != frame.verb:
                self._flush(stream, recovery, out)
            recovery.held.append(frame)
            return out
        self._flush(stream, recovery, out)
        self._received(stream, frame.position)
        if skip:
            out.append(Advance(stream, frame.position))
        else:
            event = Event(
                frame.verb,
                frame.payload,
                stream,
                frame.epoch,
                frame.offset,
                replayed=recovery is not None,
                batch=(frame.payload,),
            )
            out.append(Deliver(event, frame.position))
        return out

    def answer(self, answer: Recovered) -> list[Output]:
        """A ``recovered`` frame: the end of a replay, or a node that lost the stream."""
        stream = answer.stream
        recovery = self._recovering.pop(stream, None)
        out: list[Output] = []
        self._flush(stream, recovery, out)
        was = recovery is not None and recovery.was
        replayed = recovery.replayed if recovery is not None else 0
        position = Position(answer.epoch, answer.offset)
        held = self.received.get(stream)
        if (
            answer.recovered
            and held is not None
            and judge(held, answer.epoch, answer.offset) is Verdict.OLD
        ):
            position = held  # what the replay handed over already: never go back over it
        info = RecoveryInfo(
            stream, was, answer.recovered, replayed, position.epoch, position.offset
        )
        # A first look at a stream (no position sent) is no loss; a live answer always is.
        lost = not answer.recovered and (recovery is None or recovery.was)
        self._received(stream, position)
        if lost:
            resync = ResyncInfo(
                stream, "recovery", answer.epoch, answer.offset, was, False, replayed
            )
            out.append(Resync(resync, position))
        out.append(Report(info, None if lost else position))
        return out

    def _flush(self, stream: str, recovery: _Recovery | None, out: list[Output]) -> None:
        if recovery is None or not recovery.held:
            return
        frames, recovery.held = recovery.held, []
        top = frames[-1].position
        self._received(stream, top)
        events = [f for f in frames if f.verb != "skip"]
        if not events:
            out.append(Advance(stream, top))
            return
        last = events[-1]
        event = Event(
            last.verb,
            last.payload,
            stream,
            last.epoch,
            last.offset,
            replayed=True,
            batch=tuple(f.payload for f in events),
        )
        out.append(Deliver(event, top))

    def _received(self, stream: str, position: Position) -> None:
        self.received[stream] = position
        self.received.move_to_end(stream)
        if len(self.received) > MAX_STREAMS:
            self.received.popitem(last=False)


class Ticket:
    """One handed-over output of a stream, done when ``pending`` reaches 0."""

    __slots__ = ("pending", "position", "stream")

    def __init__(self, stream: str, position: Position, pending: int) -> None:
        self.stream = stream
        self.position = position
        self.pending = pending


class Commits:
    """Committed positions: each stream advances over its outputs in the order they
    were handed over, only as far as every handler of each is done."""

    def __init__(self, positions: Mapping[str, Position]) -> None:
        self.committed: OrderedDict[str, Position] = OrderedDict(positions)
        self._open: dict[str, deque[Ticket]] = {}

    def expect(self, stream: str, position: Position, pending: int) -> Ticket:
        ticket = Ticket(stream, position, pending)
        self._open.setdefault(stream, deque()).append(ticket)
        return ticket

    def release(self, ticket: Ticket) -> bool:
        """One handler of ``ticket`` is done; True when the stream's commit moved."""
        ticket.pending -= 1
        return self.settle(ticket.stream)

    def settle(self, stream: str) -> bool:
        queue = self._open.get(stream)
        moved = False
        while queue and queue[0].pending <= 0:
            position = queue.popleft().position
            self.committed[stream] = position
            self.committed.move_to_end(stream)
            moved = True
        if queue is not None and not queue:
            del self._open[stream]
        if moved and len(self.committed) > MAX_STREAMS:
            self.committed.popitem(last=False)
        return moved

    def outstanding(self) -> int:
        return sum(len(queue) for queue in self._open.values())
