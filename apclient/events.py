"""What the client hands the application: one small frozen value per kind of event.

Every value has a ``verb``, so ``async for event in client`` can ``match event.verb``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from protocol.messages import Ply

State = Literal["disconnected", "connecting", "connected"]
TurnSource = Literal["pendingTurns", "yourTurn"]


@dataclass(frozen=True, slots=True)
class Event:
    """A server event: ``game``, ``chat``, ``yourTurn``, ``notification``, ``pendingTurns``...

    Stream events carry their position. ``batch`` holds every payload this one
    call stands for, oldest first: one, or a whole replayed burst of a coalesced
    verb (``payload`` and the position are then the last one's).
    """

    verb: str
    payload: Any = field(compare=False)
    stream: str | None = None
    epoch: str | None = None
    offset: int | None = None
    replayed: bool = False
    batch: tuple[Any, ...] = field(default=(), compare=False)

    @property
    def game(self) -> tuple[str, str] | None:
        """``(meta, id)`` when the payload names a game."""
        payload = self.payload
        if isinstance(payload, dict):
            meta, game_id = payload.get("meta"), payload.get("id")
            if isinstance(meta, str) and isinstance(game_id, str):
                return meta, game_id
        return None


@dataclass(frozen=True, slots=True)
class Turn:
    """A game where the bot must move, from ``pendingTurns`` or a ``yourTurn``."""

    meta: str
    id: str
    source: TurnSource
    event: Event = field(compare=False)
    verb: Literal["turn"] = "turn"
    ply: Ply | None = None
    """The ply, when the turn named it (``numMoves``, ``lastMoveTime``)."""


@dataclass(frozen=True, slots=True)
class RecoveryInfo:
    """One stream's recovery answer."""

    stream: str
    was_recovering: bool  # a position was sent for it (not a first look at the stream)
    recovered: bool
    replayed: int  # events replayed before the answer
    epoch: str = ""  # where the stream goes on from
    offset: int = 0
    verb: Literal["recovered"] = "recovered"


ResyncReason = Literal["recovery", "epoch", "gap"]


@dataclass(frozen=True, slots=True)
class ResyncInfo:
    """The application must refetch ``stream``'s state; events continue from here."""

    stream: str
    reason: ResyncReason
    epoch: str
    offset: int
    was_recovering: bool = False
    recovered: bool = False
    replayed: int = 0
    verb: Literal["resync"] = "resync"


@dataclass(frozen=True, slots=True)
class Presence:
    seq: int
    total_count: int
    visible_user_ids: frozenset[str]


@dataclass(frozen=True, slots=True)
class PresenceChange:
    """``connections``: the presence state after ``message`` (the frame's payload)."""

    presence: Presence
    message: Any = field(compare=False)
    verb: Literal["connections"] = "connections"


@dataclass(frozen=True, slots=True)
class ServerError:
    """An ``error`` frame."""

    code: str
    message: str
    ack_id: str | None = None
    client_msg_id: str | None = None
    verb: Literal["error"] = "error"


@dataclass(frozen=True, slots=True)
class Disconnected:
    """A socket closed, or an attempt at one failed (code 1006, an HTTP status in
    ``reason``). ``will_reconnect`` is False once the client has stopped; then
    ``retry_in`` is None, otherwise the seconds until the next attempt."""

    code: int
    reason: str
    will_reconnect: bool
    retry_in: float | None = None
    verb: Literal["disconnected"] = "disconnected"


@dataclass(frozen=True, slots=True)
class Connected:
    """The subscribe was acknowledged: recovery answered, watch set in place."""

    verb: Literal["connected"] = "connected"


AnyEvent = (
    Event
    | Turn
    | RecoveryInfo
    | ResyncInfo
    | PresenceChange
    | ServerError
    | Disconnected
    | Connected
)
