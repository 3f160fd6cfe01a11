"""Streams, sans I/O: names, positions, and the ordering and recovery rules.

Every game and user event has a place in a stream:

- ``game:<meta>#<id>`` carries a game's ``game`` and ``chat`` events;
- ``user:<userId>`` carries events addressed to one user.

A position is ``(epoch, offset)``: offsets count from 1 in each epoch, by
exactly one per event; a new epoch means the stream's history was lost.

Every ordering and recovery rule that needs no I/O lives here, so that it can
be tested with plain values and property-tested:

- :class:`StreamCursor` is a node's last delivered position on one stream.
  :meth:`~StreamCursor.receive` decides each live event (deliver it, drop it
  as a duplicate, repair the hole before it, or report a loss first), and
  :meth:`~StreamCursor.fill` what a history read means for a cursor with a hole;
- :func:`already_sent` is the per-client duplicate filter behind a replay;
- :func:`merge_recovery` decides what a reconnecting client gets: the missed
  events from history merged with live events buffered meanwhile, or
  ``recovered: false`` when continuity cannot be proven, and
  :func:`answer_recovery` orders one stream's whole answer.

``server/routing/`` does the reads and the writes around them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from protocol.messages import GameKey, Position

GAME_STREAM_PREFIX = "game:"
USER_STREAM_PREFIX = "user:"

MAX_SINCE_STREAMS = 1000
"""Most streams one ``since`` may name."""
MAX_USERS_PER_PUBLISH = 1000
"""Most users one ``POST /publish`` may address."""


def game_stream(key: GameKey) -> str:
    """The stream of a game: ``game:<meta>#<id>``."""
    return GAME_STREAM_PREFIX + key


def user_stream(user_id: str) -> str:
    """The stream of a user: ``user:<userId>``."""
    return USER_STREAM_PREFIX + user_id


def stream_game(stream: str) -> GameKey | None:
    """The game key of a game stream, or None for any other name."""
    if stream.startswith(GAME_STREAM_PREFIX):
        return stream[len(GAME_STREAM_PREFIX) :]
    return None


def stream_user(stream: str) -> str | None:
    """The user id of a user stream, or None for any other name."""
    if stream.startswith(USER_STREAM_PREFIX):
        return stream[len(USER_STREAM_PREFIX) :]
    return None


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HistoryRead(Generic[T]):
    """What a stream's history held at one instant.

    ``entries`` are the events after the requested offset that are still kept,
    ascending; the stream's top is ``top`` in ``epoch``.
    """

    epoch: str
    top: int
    entries: tuple[tuple[int, T], ...]


@dataclass(frozen=True, slots=True)
class RecoveryPlan(Generic[T]):
    """What to send a client: ``events`` (in order), then ``recovered``.

    When ``recovered`` is False, ``events`` is empty: a partial replay is never
    presented as complete. ``offset`` is the last offset the client is then at
    (the stream top as far as this plan knows).
    """

    recovered: bool
    epoch: str
    offset: int
    events: tuple[tuple[int, T], ...]


def merge_recovery(
    since: Position,
    history: HistoryRead[T],
    buffered: Sequence[tuple[str, int, T]],
) -> RecoveryPlan[T]:
    """Merge history read after ``since`` with live events buffered meanwhile.

    ``buffered`` are ``(epoch, offset, event)`` as they arrived live after the
    subscription was taken and before the history read returned; the history
    read is later than the subscription, so together they cover everything
    from ``since`` to the newest event, unless the history lost some.

    Recovery holds when the epochs match, the client is not ahead of the
    stream, and the merged events run from ``since.offset + 1`` to the newest
    known offset without a hole. Duplicates (an event both in history and
    live) are sent once.
    """
    epoch = history.epoch
    newest = history.top
    merged: dict[int, T] = {}
    for offset, event in history.entries:
        if offset > since.offset:
            merged[offset] = event
    for live_epoch, offset, event in buffered:
        if live_epoch != epoch:
            # The stream changed epoch after the read: nothing can be proven.
            return RecoveryPlan(False, live_epoch, max(offset - 1, 0), ())
        if offset > since.offset:
            merged.setdefault(offset, event)
        newest = max(newest, offset)
    if since.epoch != epoch or since.offset > history.top:
        return RecoveryPlan(False, epoch, newest, ())
    expected = range(since.offset + 1, newest + 1)
    if len(merged) != len(expected) or any(o not in merged for o in expected):
        return RecoveryPlan(False, epoch, newest, ())
    return RecoveryPlan(True, epoch, newest, tuple((o, merged[o]) for o in expected))


@dataclass(frozen=True, slots=True)
class RecoveryAnswer(Generic[T]):
    """One stream's answer to a client's ``since``, in the order it is sent:
    ``replay``, then ``recovered`` at ``(epoch, offset)``, then ``live``
    (events buffered meanwhile that come after that position; only when
    recovery failed, since a successful replay already holds them)."""

    recovered: bool
    epoch: str
    offset: int
    replay: tuple[tuple[int, T], ...]
    live: tuple[tuple[int, T], ...]


def answer_recovery(
    since: Position,
    history: HistoryRead[T] | None,
    buffered: Sequence[tuple[str, int, T]],
) -> RecoveryAnswer[T]:
    """The answer for one stream; ``history`` is None when it could not be read.

    Without history nothing can be proven: ``recovered: false`` just before the
    first live event buffered (or at offset 0 of the client's epoch), then the
    buffered events, so the client hears everything from there on.
    """
    if history is None:
        epoch, top = (buffered[0][0], buffered[0][1] - 1) if buffered else (since.epoch, 0)
        return RecoveryAnswer(False, epoch, top, (), _after(buffered, epoch, top))
    plan = merge_recovery(since, history, buffered)
    live = () if plan.recovered else _after(buffered, plan.epoch, plan.offset)
    return RecoveryAnswer(plan.recovered, plan.epoch, plan.offset, plan.events, live)


def _after(
    buffered: Sequence[tuple[str, int, T]], epoch: str, top: int
) -> tuple[tuple[int, T], ...]:
    return tuple((offset, event) for e, offset, event in buffered if e == epoch and offset > top)


def already_sent(last: tuple[str, int] | None, epoch: str, offset: int) -> bool:
    """Whether a client whose last sent position is ``last`` already has the event
    at ``(epoch, offset)`` (its replay sent it): then the live copy is dropped."""
    return last is not None and last[0] == epoch and offset <= last[1]


def unannounced(last: tuple[str, int] | None, epoch: str, offset: int) -> bool:
    """Whether the event at ``(epoch, offset)`` would skip past a client's last
    position ``last`` (another epoch, or a hole) without a ``recovered: false``:
    then the client is told one first, at ``offset - 1``."""
    return last is not None and (last[0] != epoch or offset > last[1] + 1)


class Step(Enum):
    """What a node does with one incoming event of a stream."""

    DELIVER = "deliver"  # the next offset (or the first one heard): deliver it
    DUPLICATE = "duplicate"  # at or below what was delivered: drop it
    GAP = "gap"  # beyond the next offset: fill the hole from history first
    NEW_EPOCH = "new_epoch"  # the stream lost its history: read the new epoch's, tell, deliver


@dataclass(frozen=True, slots=True)
class Arrival:
    """What a node does with one live event, as its stream's cursor decided.

    First, when ``lost`` is set, the stream's speakers are told ``recovered:
    false`` at that position (continuity cannot be proven); then, when
    ``deliver``, the event is delivered (the cursor is at it). Otherwise the
    event is a duplicate (dropped) or, when :attr:`repair`, it waits while the
    hole before it (or the new epoch's first events) is read from history.
    """

    step: Step
    deliver: bool
    lost: Position | None = None

    @property
    def repair(self) -> bool:
        return self.step in (Step.GAP, Step.NEW_EPOCH) and not self.deliver


@dataclass(frozen=True, slots=True)
class Repair(Generic[T]):
    """What a history read means for a cursor with a hole: first, when ``lost``
    is set, the speakers refetch from there; then ``events`` are delivered, in order."""

    lost: Position | None
    events: tuple[tuple[int, T], ...]


_DELIVER = Arrival(Step.DELIVER, True)
_DUPLICATE = Arrival(Step.DUPLICATE, False)
_REPAIR = Arrival(Step.GAP, False)
_REPAIR_EPOCH = Arrival(Step.NEW_EPOCH, False)


class StreamCursor:
    """The last position a node delivered on one stream."""

    __slots__ = ("epoch", "offset")

    def __init__(self, epoch: str | None = None, offset: int = 0) -> None:
        self.epoch = epoch
        self.offset = offset

    def step(self, epoch: str, offset: int) -> Step:
        if self.epoch is None:
            return Step.DELIVER
        if epoch != self.epoch:
            return Step.NEW_EPOCH
        if offset <= self.offset:
            return Step.DUPLICATE
        if offset == self.offset + 1:
            return Step.DELIVER
        return Step.GAP

    def advance(self, epoch: str, offset: int) -> None:
        self.epoch = epoch
        self.offset = offset

    def take_next(self, epoch: str, offset: int) -> bool:
        """Move to ``(epoch, offset)`` if it is the very next event of this cursor's
        epoch; whether it moved. Unlike :meth:`step`, a cursor that has delivered
        nothing knows no next event, so it declines."""
        if epoch != self.epoch or offset != self.offset + 1:
            return False
        self.offset = offset
        return True

    def receive(self, epoch: str, offset: int, *, repairing: bool) -> Arrival:
        """Decide one live event, and move to it when it is to be delivered.

        ``repairing``: the hole before the event has just been read from history,
        so a gap left now cannot be filled and is reported as lost instead.

        A new epoch is read from history too: its first events may have been
        published before this node heard the stream again (a Redis restart),
        and the speakers must hear of the epoch before any of its events.
        """
        step = self.step(epoch, offset)
        if step is Step.DELIVER:
            self.advance(epoch, offset)
            return _DELIVER
        if step is Step.DUPLICATE:
            return _DUPLICATE
        if not repairing:
            if step is Step.GAP:
                return _REPAIR
            if step is Step.NEW_EPOCH:
                return _REPAIR_EPOCH
        self.advance(epoch, offset)
        return Arrival(step, True, Position(epoch, offset - 1))

    def fill(self, history: HistoryRead[T]) -> Repair[T]:
        """Take what ``history`` (read after this cursor's offset) holds of the hole,
        and move to the last event it delivers.

        When the hole is gone from history (or the stream has a new epoch), the
        speakers must refetch from just before what history still holds, so
        that everyone still hears every event it has.
        """
        lost = None
        entries = history.entries
        if history.epoch != self.epoch or (entries and entries[0][0] > self.offset + 1):
            base = entries[0][0] - 1 if entries else history.top
            lost = Position(history.epoch, base)
            self.advance(history.epoch, base)
        elif not entries and self.offset < history.top:
            lost = Position(history.epoch, history.top)
            self.advance(history.epoch, history.top)
        events: list[tuple[int, T]] = []
        for offset, event in entries:
            if offset == self.offset + 1:
                self.advance(history.epoch, offset)
                events.append((offset, event))
        return Repair(lost, tuple(events))


def contiguous_after(start: int, offsets: Iterable[int]) -> bool:
    """True when ``offsets`` are exactly ``start + 1, start + 2, ...``."""
    expected = start + 1
    for offset in offsets:
        if offset != expected:
            return False
        expected += 1
    return True
