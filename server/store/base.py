"""The store interface: where connection rows and the presence sequence live.

Two implementations share one contract suite (``tests/contract``): the
in-memory store of the embedded default, and DynamoDB. Records keep the exact
keys and attributes of Abstract Play's single table (``docs/access-patterns.md``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from server.store.records import AppendOutcome, GameAccess, StoredComment

CONNECTION_TTL_SECONDS = 86_400
"""A row's ``ttl`` is now + 24 h, as today; live connections refresh it."""


@dataclass(frozen=True, slots=True)
class ConnectionRecord:
    """One ``pk=wsConnections`` row."""

    connection_id: str
    user_id: str
    invisible: bool
    endpoint: str
    wants_presence: bool
    watch_version: int | None
    watching_games: frozenset[str]
    ttl: int


@dataclass(frozen=True, slots=True)
class StreamReaderState:
    """The ``wsMeta/notificationStream`` row, after a new reader took its fence."""

    fence: int
    """Higher than any earlier reader's: checkpoints written with a lower one are refused."""
    started_at_ms: int
    """When a reader first read this stream; records older than this are never pushed."""
    fresh: bool
    """True on the very first start on this stream: begin at its latest record."""


@dataclass(frozen=True, slots=True)
class ShardCheckpoint:
    """One ``wsMeta/streamShard#<shardId>`` row: how far a shard of the stream was read."""

    shard_id: str
    sequence_number: str | None
    """The last record handled; None when the shard was opened at LATEST and had none yet."""
    done: bool
    """The shard is closed and was read to its end."""


STREAM_CHECKPOINT_TTL_SECONDS = 2 * 86_400
"""A stream keeps records 24 h; a shard's checkpoint is useless a day after that."""


class Fenced(Exception):
    """A newer stream reader took over: this one must stop writing checkpoints."""


@dataclass(frozen=True, slots=True)
class BotRecord:
    """One ``pk=BOT`` row (written by the backend's ``create_bot``; read-only here)."""

    client_id: str
    name: str
    owner: str


ToMove = str | tuple[bool, ...] | None
"""A game's ``toMove``: a player index as a string, one flag per player for
simultaneous games, or None when the row has neither."""


@dataclass(frozen=True, slots=True)
class CurrentGame:
    """The fields of one ``pk=CURRENTGAMES#<userId>`` row that routing needs."""

    game_id: str
    meta: str
    player_ids: tuple[str, ...]
    to_move: ToMove


@dataclass(frozen=True, slots=True)
class BotCandidate:
    """One ``pk=BOTTURNS#<botId>`` row: a game that may wait for the bot's move."""

    game_id: str
    meta: str
    added_at_ms: int
    """When a ``move`` message last named the game; a prune is conditional on it."""


BOT_CANDIDATE_TTL_SECONDS = 30 * 86_400
"""A candidate no subscribe ever looked at (a webhook-only bot) goes after 30 days;
every ``move`` message for the game pushes it forward."""


def ttl_from_now(now: float | None = None) -> int:
    """The ``ttl`` value, epoch seconds, for a row written now."""
    return int(now if now is not None else time.time()) + CONNECTION_TTL_SECONDS


class StoreUnavailable(Exception):
    """The store could not be reached or refused the request after retries."""


class Store(Protocol):
    """Persistence for connection rows, the ``wsMeta`` presence counter, and the game-side
    records the services read and write (bots, chat, dashboard marks, lastSeen)."""

    async def start(self) -> None:
        """Connect and check the table is reachable; raise StoreUnavailable if not."""

    async def close(self) -> None:
        """Release clients and sockets."""

    async def write_connections(
        self, puts: Sequence[ConnectionRecord], deletes: Sequence[str]
    ) -> None:
        """Put whole rows and delete rows by connection id, in batches.

        A connection id appears at most once across ``puts`` and ``deletes``.
        Returns only when every item is written; raises StoreUnavailable otherwise.
        """

    async def update_watch(
        self, connection_id: str, games: frozenset[str], watch_version: int, ttl: int
    ) -> None:
        """Replace ``watchingGames`` (removed when empty), set ``watchVersion`` and ``ttl``."""

    async def refresh_ttl(self, connection_id: str, ttl: int) -> None:
        """Push a live row's ``ttl`` forward."""

    async def get_connection(self, connection_id: str) -> ConnectionRecord | None:
        """One row, or None when absent or past its ``ttl``."""

    async def list_connections(self) -> list[ConnectionRecord]:
        """Every row not past its ``ttl``. For operators and tests, never a hot path."""

    async def delete_endpoint_connections(self, endpoint: str) -> int:
        """Delete every row whose ``endpoint`` is this node's; returns how many."""

    async def reserve_presence_seq(self, seq: int) -> int:
        """Raise ``wsMeta/presenceSeq`` to ``seq`` unless it is there or beyond,
        and return the value it holds then (``seq`` or more).

        Idempotent: a retry of a call that applied (a read timeout) changes
        nothing and answers the same, so the presence seq cannot skip."""

    async def current_presence_seq(self) -> int:
        """The ``wsMeta/presenceSeq`` value, 0 when never written."""

    async def take_stream_fence(self, stream_arn: str, now_ms: int) -> StreamReaderState:
        """Become the stream's reader: add 1 to the fence; note the first start.

        A different ``stream_arn`` than the stored one (the stream was re-created)
        counts as a first start.
        """

    async def stream_checkpoints(self, stream_arn: str) -> dict[str, ShardCheckpoint]:
        """Every shard checkpoint of this stream, by shard id."""

    async def save_stream_checkpoint(
        self, stream_arn: str, checkpoint: ShardCheckpoint, fence: int
    ) -> None:
        """Write a shard's checkpoint; raise :class:`Fenced` if a higher fence wrote it."""

    # --- game-side records (server/services) ---------------------------------

    async def get_game_access(self, meta: str, game_id: str) -> GameAccess:
        """Whether the game is active, completed or unknown, and its players' ids.

        Reads the active ``GAME`` row with a projection of ``players`` only; the
        completed row is looked at only when there is no active one.
        """

    async def is_admin(self, user_id: str) -> bool:
        """``USER/<userId>.admin`` is true."""

    async def append_comment(self, game_id: str, comment: StoredComment, key: str) -> AppendOutcome:
        """Append one comment to ``GAMECOMMENTS/<gameId>`` atomically.

        Stored at most once per ``key`` (see ``records.comment_key``); refused,
        with the item unchanged, when Σ(110 + UTF-8 bytes) would reach the cap.
        """

    async def append_comments(
        self, game_id: str, entries: Sequence[tuple[StoredComment, str]]
    ) -> list[AppendOutcome]:
        """``append_comment`` for each ``(comment, key)`` in order, one outcome each, as
        few writes as the store allows (a group commit's batch: usually one)."""

    async def game_watchers(self, game_id: str) -> list[str]:
        """User ids under ``GAMEWATCHERS#<gameId>``."""

    async def mark_players_last_chat(
        self, game_id: str, players: Sequence[str], authors: Mapping[str, int]
    ) -> None:
        """Set ``USERGAME#<uid>/<gameId>.lastChat`` for each human player who has the
        game on their dashboard (a ``CURRENTGAMES#`` row). ``authors``: each author's
        latest comment (ms); ``lastChat`` is the latest of them, and an author's row
        also gets ``seen`` just after their own. One write per row, however many
        authors."""

    async def mark_watchers_last_chat(
        self, game_id: str, watchers: Sequence[str], authors: Mapping[str, int]
    ) -> None:
        """As :meth:`mark_players_last_chat`, on each watcher's existing
        ``WATCHED#<uid>/<gameId>`` row; a missing row is not created."""

    async def touch_last_seen(self, user_id: str, now_ms: int) -> bool:
        """Set ``USERS/<userId>.lastSeen = now`` if it is missing or older than 15
        minutes and the row exists; True when written."""

    async def touch_last_seen_many(self, touches: Mapping[str, int]) -> set[str]:
        """``touch_last_seen`` for each user id → now_ms, in as few requests as the
        store allows; the user ids written. Raises StoreUnavailable when the
        outcome of some is unknown (the caller retries them: they are idempotent)."""

    async def get_bot(self, client_id: str) -> BotRecord | None:
        """The ``BOT`` row of this app client id, or None when there is none."""

    async def current_games(self, user_id: str) -> list[CurrentGame]:
        """Every ``CURRENTGAMES#<userId>`` row (all pages); rows without a game id
        or metaGame are skipped."""

    async def add_bot_candidates(
        self, candidates: Sequence[tuple[str, str, str]], now_ms: int
    ) -> None:
        """Put ``BOTTURNS#<botId>/<gameId>`` for each ``(bot id, metaGame, game id)``
        (idempotent: a re-send only moves ``addedAt``; a repeat in one call is one put)."""

    async def bot_candidates(self, bot_id: str) -> list[BotCandidate]:
        """Every ``BOTTURNS#<botId>`` row (all pages)."""

    async def drop_bot_candidate(self, bot_id: str, game_id: str, added_at_ms: int) -> bool:
        """Delete the candidate unless a message re-added it since (``addedAt`` moved)."""

    async def active_games(self, keys: Sequence[tuple[str, str]]) -> dict[str, CurrentGame]:
        """The active ``GAME`` rows (``<meta>#0#<id>``) of these (meta, game id) pairs,
        by game id, projecting ``id``, ``metaGame``, ``players`` and ``toMove``; a
        game without an active row (over, or not written yet) is absent."""
