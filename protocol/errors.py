"""Error codes, close codes and limits shared by the server and its clients."""

from __future__ import annotations

from enum import IntEnum, StrEnum


class ErrorCode(StrEnum):
    """``payload.code`` of an ``error`` frame."""

    INVALID_FRAME = "invalid_frame"
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_ACTION = "unknown_action"
    NOT_SUBSCRIBED = "not_subscribed"
    UNAUTHORIZED = "unauthorized"
    TOO_MANY_GAMES = "too_many_games"
    USER_MISMATCH = "user_mismatch"
    UNAVAILABLE = "unavailable"
    # flood credits spent (the close 1008 follows), or chat over --chat-rate (nothing stored)
    RATE_LIMITED = "rate_limited"
    TOO_MANY_CONNECTIONS = "too_many_connections"  # the close (4509) follows
    COMMENT_EMPTY = "comment_empty"
    COMMENT_TOO_LONG = "comment_too_long"
    COMMENTS_FULL = "comments_full"
    NOT_ALLOWED = "not_allowed"
    GAME_NOT_FOUND = "game_not_found"
    GAME_COMPLETED = "game_completed"
    STREAM_NOT_ALLOWED = "stream_not_allowed"


class CloseCode(IntEnum):
    """WebSocket close codes the server uses."""

    GOING_AWAY = 1001  # the browser treats this as an idle timeout
    POLICY_VIOLATION = 1008  # bad token, or a flood (after a rate_limited error frame)
    MESSAGE_TOO_BIG = 1009  # frame over MAX_FRAME_BYTES
    INTERNAL_ERROR = 1011  # no answer to a keepalive ping, as websockets would close it
    SERVICE_RESTART = 1012  # drain on deploy: reconnect at once
    TRY_AGAIN_LATER = 1013  # a token or a bot's games could not be checked now
    SLOW_CONSUMER = 4008  # outbox overflow: the client could not keep up
    SUBSCRIBE_DEADLINE = 4408  # no subscribe within --subscribe-timeout
    # over --max-connections-per-user (bots: --bot-max-connections)
    TOO_MANY_CONNECTIONS = 4509


class ProtocolError(Exception):
    """Untrusted input was rejected; carries the error frame to send back."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        client_msg_id: str | None = None,
        ack_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # Echoed in the error frame so a client can tell which of its messages failed.
        self.client_msg_id = client_msg_id
        self.ack_id = ack_id


MAX_FRAME_BYTES = 64 * 1024
"""Largest client frame accepted; larger ones are closed with 1009."""

MAX_WATCHED_GAMES = 1000
"""Most games one connection may watch; keeps a row far below DynamoDB's 400 KB."""

MAX_GAME_FIELD_CHARS = 128
"""Longest ``meta`` or ``id`` of a game ref."""

GAME_KEY_SEPARATOR = "#"
"""Joins ``meta`` and ``id`` in a game key; ``meta`` may not contain it, so keys never collide."""

MAX_TOKEN_CHARS = 16 * 1024

MSGPACK_SUBPROTOCOL = "ap.msgpack"

MAX_COMMENT_UNITS = 16_000
"""Longest comment accepted, in UTF-16 code units (JavaScript's ``length``); longer is
refused with ``comment_too_long``."""

STORED_COMMENT_UNITS = 4000
"""Comments are cut to this many UTF-16 code units, as today's backend and front do."""

MAX_CLIENT_MSG_ID_CHARS = 128
"""Longest ``clientMsgId`` (a UUID is 36)."""

MAX_MOVE_NUMBER = 1_000_000_000

MAX_ACK_ID_CHARS = 64
"""Longest ``ackId`` of a ``subscribe`` or ``watchGames``."""
