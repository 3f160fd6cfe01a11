"""Keys, attribute names and values of the game-side records the services touch.

They are Abstract Play's live records (``docs/access-patterns.md``); only the
attributes named here are read or written, and every other attribute of a row
is left as it is. Timestamps are epoch milliseconds, as the backend writes them.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from enum import Enum

# pk values and prefixes.
GAME_PK = "GAME"
USER_PK = "USER"
USERS_PK = "USERS"
BOT_PK = "BOT"
GAMECOMMENTS_PK = "GAMECOMMENTS"
USERGAME_PREFIX = "USERGAME#"
WATCHED_PREFIX = "WATCHED#"
GAMEWATCHERS_PREFIX = "GAMEWATCHERS#"
CURRENTGAMES_PREFIX = "CURRENTGAMES#"
BOTTURNS_PREFIX = "BOTTURNS#"
"""New: ``BOTTURNS#<botId>/<gameId>``, the games a ``move`` message named for the bot."""

# Attributes.
PLAYERS = "players"
PLAYER_ID = "id"
ADMIN = "admin"
COMMENTS = "comments"
COMMENT_BYTES = "commentBytes"
"""New: Σ(110 + UTF-8 bytes) over ``comments``, kept by the conditional append."""
COMMENT_IDS = "commentIds"
"""New: map of comment key (a digest of author and clientMsgId) to its ``timeStamp``."""
LAST_CHAT = "lastChat"
SEEN = "seen"
LAST_SEEN = "lastSeen"
META_GAME = "metaGame"
ADDED_AT = "addedAt"
TTL = "ttl"

# A stored comment's fields.
COMMENT = "comment"
USER_ID = "userId"
MOVE_NUMBER = "moveNumber"
TIME_STAMP = "timeStamp"

AUTHOR_SEEN_LEAD_MS = 10
"""The backend sets the author's ``seen`` to lastChat + 10 ms, so their own comment is read."""

LAST_SEEN_INTERVAL_MS = 15 * 60 * 1000
"""``USERS.lastSeen`` is written only when missing or older than this (``touchUserLastSeen``)."""


def game_sk(meta: str, game_id: str, completed: bool) -> str:
    """``<metaGame>#<completedbit>#<gameId>``."""
    return f"{meta}#{1 if completed else 0}#{game_id}"


def comment_key(user_id: str, client_msg_id: str) -> str:
    """The idempotency key of a comment: 12 characters whatever the ids' lengths.

    A digest, not the ids themselves, so each comment adds about 21 bytes to the
    item, inside the 110 bytes per comment that the cap already counts.
    """
    digest = hashlib.blake2b(
        f"{user_id}\x00{client_msg_id}".encode(), digest_size=9, person=b"ap-chat"
    ).digest()
    return base64.urlsafe_b64encode(digest).decode()


@dataclass(frozen=True, slots=True)
class StoredComment:
    """One element of ``GAMECOMMENTS.comments``."""

    comment: str
    user_id: str
    move_number: int
    time_stamp: int

    def to_plain(self) -> dict[str, object]:
        return {
            COMMENT: self.comment,
            USER_ID: self.user_id,
            MOVE_NUMBER: self.move_number,
            TIME_STAMP: self.time_stamp,
        }


class GameStatus(Enum):
    ACTIVE = "active"
    COMPLETED = "completed"
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class GameAccess:
    """What chat needs of a ``GAME`` row: whether it is active, and its players' ids."""

    status: GameStatus
    players: tuple[str, ...] = ()


class AppendStatus(Enum):
    STORED = "stored"
    DUPLICATE = "duplicate"  # this clientMsgId was stored before; nothing changed
    FULL = "full"  # the cap would be passed; nothing changed


@dataclass(frozen=True, slots=True)
class AppendOutcome:
    status: AppendStatus
    # The stored comment's timeStamp (the first one's, for a duplicate); 0 when full.
    time_stamp: int = 0
