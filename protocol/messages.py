"""Typed messages at every boundary: client in, server out, backend in.

Every value here is a frozen dataclass built by :mod:`protocol.parse` from
untrusted input, or by the server before encoding. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

GameKey = str
"""A watched game as stored in ``watchingGames``: ``"<metaGame>#<gameId>"``."""


@dataclass(frozen=True, slots=True)
class Position:
    """Where an event sits in its stream: ``offset`` counts from 1 within ``epoch``."""

    epoch: str
    offset: int


Since = dict[str, Position]
"""``since`` of ``subscribe``/``watchGames``: stream name -> last position seen."""


def game_key(meta: str, game_id: str) -> GameKey:
    """Build the ``watchingGames`` key of a game."""
    return f"{meta}#{game_id}"


# --- client -> server -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Subscribe:
    """``{"action":"subscribe", ...}``: authenticate and join presence."""

    token: str
    invisible: bool = False
    # None when the client did not say: humans then get presence, bots do not.
    wants_presence: bool | None = None
    watch_version: int | None = None
    # None means the client sent no ``games`` field (a legacy client).
    games: frozenset[GameKey] | None = None
    # None: the client sent no ``since`` (it does not speak streams).
    since: Since | None = None
    # Answer with an ``ack`` once the whole action is applied (None: no ack).
    ack_id: str | None = None
    # Send this socket a ``heartbeat`` frame every --heartbeat-seconds.
    heartbeat: bool = False


@dataclass(frozen=True, slots=True)
class WatchGames:
    """``{"action":"watchGames","games":[...]}``: replace the watch set."""

    games: frozenset[GameKey]
    since: Since | None = None
    ack_id: str | None = None


@dataclass(frozen=True, slots=True)
class SyncPresence:
    """``{"action":"syncPresence"}``: ask for a fresh presence snapshot."""


@dataclass(frozen=True, slots=True)
class Chat:
    """``{"action":"chat",...}``: post a comment on a game.

    ``comment`` is already validated (not blank, not over the limit) and cut to
    :data:`~protocol.errors.STORED_COMMENT_UNITS`.
    """

    meta: str
    game_id: str
    comment: str
    move_number: int
    client_msg_id: str

    @property
    def key(self) -> GameKey:
        return game_key(self.meta, self.game_id)


ClientAction = Subscribe | WatchGames | SyncPresence | Chat


# --- server -> client -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PresenceSnapshot:
    """The committed presence state, exactly as of ``seq``."""

    seq: int
    total_count: int
    visible_user_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PresenceDelta:
    """The change from ``seq - 1`` to ``seq``.

    ``total_count`` is the count after the change; old clients ignore it.
    """

    seq: int
    joins: tuple[str, ...]
    leaves: tuple[str, ...]
    total_count: int


GameVerb = Literal["game", "chat"]
GAME_VERBS: frozenset[str] = frozenset({"game", "chat"})


@dataclass(frozen=True, slots=True)
class GameEvent:
    """``game`` or ``chat``: "this game changed, refetch it"."""

    verb: GameVerb
    meta: str
    game_id: str
    # The payload as the backend sent it; forwarded unchanged to clients.
    payload: dict[str, Any] = field(compare=False)

    @property
    def key(self) -> GameKey:
        return game_key(self.meta, self.game_id)


UserVerb = Literal["yourTurn", "notification", "challenge", "gameStart", "gameEnd"]
USER_VERBS: frozenset[str] = frozenset(
    {"yourTurn", "notification", "challenge", "gameStart", "gameEnd"}
)
"""Verbs of events addressed to users (``POST /publish`` with ``users``)."""


@dataclass(frozen=True, slots=True)
class UserEvent:
    """An event for every connection of each of ``users``, on their user streams."""

    verb: str
    users: tuple[str, ...]
    payload: Any = field(compare=False)


@dataclass(frozen=True, slots=True)
class BotOutbound:
    """One body of today's bot outbound queue (``BOT_OUTBOUND_QUEUE_URL``):
    ``{"type":"move","metaGame","gameid","botId"}`` or
    ``{"type":"challenge","challengeId","metaGame","botId","standing"}``."""

    type: Literal["move", "challenge"]
    bot_id: str
    meta: str
    game_id: str = ""  # a move's
    challenge_id: str = ""  # a challenge's
    standing: bool = False

    def event(self) -> UserEvent:
        """The event on the bot's user stream: ``yourTurn`` or ``challenge``."""
        if self.type == "move":
            return UserEvent("yourTurn", (self.bot_id,), {"meta": self.meta, "id": self.game_id})
        payload = {"challengeId": self.challenge_id, "meta": self.meta, "standing": self.standing}
        return UserEvent("challenge", (self.bot_id,), payload)


@dataclass(frozen=True, slots=True)
class AdminTest:
    """``test``: an admin broadcast to everyone, shown as a toast."""

    payload: Any


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """``{"verb":"error","payload":{"code":...,"message":...}}``.

    ``clientMsgId`` is added to the payload when the failed message carried one.
    """

    code: str
    message: str
    client_msg_id: str | None = None
    # The ``ackId`` of the subscribe or watchGames this error answers.
    ack_id: str | None = None


@dataclass(frozen=True, slots=True)
class ChatAck:
    """``{"verb":"chatAck","payload":{"clientMsgId","timeStamp"}}``: the comment is durable."""

    client_msg_id: str
    time_stamp: int


AckedAction = Literal["subscribe", "watchGames"]


@dataclass(frozen=True, slots=True)
class Ack:
    """``{"verb":"ack","payload":{"ackId","action"}}``: the whole action is applied.

    ``heartbeat_seconds`` is set on the ack of a subscribe that asked for heartbeats.
    """

    ack_id: str
    action: AckedAction
    heartbeat_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """``{"verb":"heartbeat","payload":{}}``: sent to sockets that asked, every
    --heartbeat-seconds, for clients that cannot see protocol pings (browsers)."""


@dataclass(frozen=True, slots=True)
class Ply:
    """Which ply of a game a turn is for, as the game's summary row names it:
    ``numMoves`` (moves made so far) and ``lastMoveTime`` (epoch ms of the last
    one). A turn names at least one; both only grow as the game goes on."""

    moves: int | None = None
    time: float | None = None


def ply_fields(ply: Ply) -> dict[str, Any]:
    """``ply`` as a turn's fields: ``numMoves`` and ``lastMoveTime``, where known."""
    fields: dict[str, Any] = {}
    if ply.moves is not None:
        fields["numMoves"] = ply.moves
    if ply.time is not None:
        fields["lastMoveTime"] = ply.time
    return fields


def ply_of(fields: Any) -> Ply | None:
    """The ply a turn's fields name (a ``yourTurn`` payload, a ``pendingTurns`` entry);
    None when neither ``numMoves`` (a whole number from 0) nor ``lastMoveTime`` (a
    number) is there. Anything else in those fields is ignored, not an error."""
    if not isinstance(fields, dict):
        return None
    moves, time = fields.get("numMoves"), fields.get("lastMoveTime")
    ply = Ply(
        moves if isinstance(moves, int) and not isinstance(moves, bool) and moves >= 0 else None,
        time if isinstance(time, int | float) and not isinstance(time, bool) else None,
    )
    return None if ply.moves is None and ply.time is None else ply


@dataclass(frozen=True, slots=True)
class PendingTurns:
    """``pendingTurns``: every current game where a bot is to move, sent on subscribe."""

    games: tuple[tuple[str, str], ...]  # (meta, id)
    plies: tuple[Ply | None, ...] = ()
    """Empty, or one per game: its ply where the rows tell it (``numMoves``, ``lastMoveTime``)."""


@dataclass(frozen=True, slots=True)
class Positioned:
    """A stream event as sent to clients: the event plus its stream position."""

    event: GameEvent | UserEvent
    stream: str
    epoch: str
    offset: int


@dataclass(frozen=True, slots=True)
class Skip:
    """In place of an event the connection is excluded from (stream speakers only)."""

    stream: str
    epoch: str
    offset: int


@dataclass(frozen=True, slots=True)
class Recovered:
    """The outcome of recovery for one stream; ``offset`` is the stream's top."""

    stream: str
    recovered: bool
    epoch: str
    offset: int


ServerMessage = (
    PresenceSnapshot
    | PresenceDelta
    | GameEvent
    | UserEvent
    | AdminTest
    | ErrorMessage
    | Positioned
    | Skip
    | Recovered
    | PendingTurns
    | ChatAck
    | Ack
    | Heartbeat
)


# --- backend -> server ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Today's SQS broadcast body: ``{"verb","payload","exclude"}``, or a user
    event (``{"verb","payload","users","exclude"}``)."""

    event: GameEvent | AdminTest | UserEvent
    exclude: frozenset[str] = frozenset()
