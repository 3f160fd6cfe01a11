"""Streams, sans I/O: names, the recovery decision, and the per-stream cursor.

Every game and user event has a place in a stream:

- ``game:<meta>#<id>`` carries a game's ``game`` and ``chat`` events;
- ``user:<userId>`` carries events addressed to one user.

A position is ``(epoch, offset)``: offsets count from 1 in each epoch, by
exactly one per event; a new epoch means the stream's history was lost.

The two pure pieces of logic live here so that they can be property-tested:

- :func:`merge_recovery` decides what a reconnecting client gets: the missed
  events from history merged with live events buffered meanwhile, or
  ``recovered: false`` when continuity cannot be proven;
- :class:`StreamCursor` tells a node, for each incoming event, whether to
  deliver it, drop it as a duplicate, repair a gap first, or report an epoch
  change.
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


class Step(Enum):
    """What a node does with one incoming event of a stream."""

    DELIVER = "deliver"  # the next offset (or the first one heard): deliver it
    DUPLICATE = "duplicate"  # at or below what was delivered: drop it
    GAP = "gap"  # beyond the next offset: fill the hole from history first
    NEW_EPOCH = "new_epoch"  # the stream lost its history: tell watchers, then deliver


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


def contiguous_after(start: int, offsets: Iterable[int]) -> bool:
    """True when ``offsets`` are exactly ``start + 1, start + 2, ...``."""
    expected = start + 1
    for offset in offsets:
        if offset != expected:
            return False
        expected += 1
    return True
