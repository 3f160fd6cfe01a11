"""In-memory store: the embedded default, and the reference for the contract."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

from protocol.chat import COMMENTS_CAP_BYTES, comment_weight
from server.store import records as r
from server.store.base import (
    BOT_CANDIDATE_TTL_SECONDS,
    BotCandidate,
    BotRecord,
    ConnectionRecord,
    CurrentGame,
    Fenced,
    ShardCheckpoint,
    StreamReaderState,
    ToMove,
)
from server.store.records import (
    AppendOutcome,
    AppendStatus,
    GameAccess,
    GameStatus,
    StoredComment,
)

Row = dict[str, Any]


class MemoryStore:
    """A process-local store with the same semantics as the DynamoDB one."""

    def __init__(self) -> None:
        self._connections: dict[str, ConnectionRecord] = {}
        self._presence_seq = 0
        self._reader: tuple[str, int, int] | None = None  # stream arn, started at, fence
        self._checkpoints: dict[
            str, tuple[str, ShardCheckpoint, int]
        ] = {}  # shard -> (arn, .., fence)
        # Game-side rows by (pk, sk), attributes as plain Python values.
        self._rows: dict[tuple[str, str], Row] = {}

    # --- plain rows: how tests and tools seed and read the game-side records ----

    def put_row(self, pk: str, sk: str, attributes: Row) -> None:
        """Replace a whole row (a copy is kept)."""
        self._rows[(pk, sk)] = copy.deepcopy(attributes)

    def delete_row(self, pk: str, sk: str) -> None:
        """Remove a row, if there is one."""
        self._rows.pop((pk, sk), None)

    def get_row(self, pk: str, sk: str) -> Row | None:
        """A copy of a row, or None."""
        row = self._rows.get((pk, sk))
        return copy.deepcopy(row) if row is not None else None

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def write_connections(
        self, puts: Sequence[ConnectionRecord], deletes: Sequence[str]
    ) -> None:
        for record in puts:
            self._connections[record.connection_id] = record
        for connection_id in deletes:
            self._connections.pop(connection_id, None)

    async def update_watch(
        self, connection_id: str, games: frozenset[str], watch_version: int, ttl: int
    ) -> None:
        record = self._connections.get(connection_id)
        if record is not None:
            self._connections[connection_id] = dataclasses.replace(
                record, watching_games=games, watch_version=watch_version, ttl=ttl
            )

    async def refresh_ttl(self, connection_id: str, ttl: int) -> None:
        record = self._connections.get(connection_id)
        if record is not None:
            self._connections[connection_id] = dataclasses.replace(record, ttl=ttl)

    async def get_connection(self, connection_id: str) -> ConnectionRecord | None:
        record = self._connections.get(connection_id)
        if record is None or record.ttl <= time.time():
            return None
        return record

    async def list_connections(self) -> list[ConnectionRecord]:
        now = time.time()
        return [record for record in self._connections.values() if record.ttl > now]

    async def delete_endpoint_connections(self, endpoint: str) -> int:
        doomed = [cid for cid, rec in self._connections.items() if rec.endpoint == endpoint]
        for connection_id in doomed:
            del self._connections[connection_id]
        return len(doomed)

    async def reserve_presence_seq(self, seq: int) -> int:
        self._presence_seq = max(self._presence_seq, seq)
        return self._presence_seq

    async def current_presence_seq(self) -> int:
        return self._presence_seq

    async def take_stream_fence(self, stream_arn: str, now_ms: int) -> StreamReaderState:
        fence = (self._reader[2] if self._reader is not None else 0) + 1
        fresh = self._reader is None or self._reader[0] != stream_arn
        started = now_ms if fresh or self._reader is None else self._reader[1]
        self._reader = (stream_arn, started, fence)
        return StreamReaderState(fence=fence, started_at_ms=started, fresh=fresh)

    async def stream_checkpoints(self, stream_arn: str) -> dict[str, ShardCheckpoint]:
        return {
            shard: checkpoint
            for shard, (arn, checkpoint, _) in self._checkpoints.items()
            if arn == stream_arn
        }

    async def save_stream_checkpoint(
        self, stream_arn: str, checkpoint: ShardCheckpoint, fence: int
    ) -> None:
        held = self._checkpoints.get(checkpoint.shard_id)
        if held is not None and held[2] > fence:
            raise Fenced(f"shard {checkpoint.shard_id} was checkpointed with fence {held[2]}")
        self._checkpoints[checkpoint.shard_id] = (stream_arn, checkpoint, fence)

    # --- the backend's BOT and CURRENTGAMES# rows (read by the bot service) ------

    async def get_bot(self, client_id: str) -> BotRecord | None:
        row = self._rows.get((r.BOT_PK, client_id))
        if row is None:
            return None
        return BotRecord(client_id, str(row.get("name", "")), str(row.get("owner", "")))

    async def current_games(self, user_id: str) -> list[CurrentGame]:
        pk = r.CURRENTGAMES_PREFIX + user_id
        games: list[CurrentGame] = []
        for (row_pk, sk), row in sorted(self._rows.items()):
            if row_pk != pk:
                continue
            game_id, meta = row.get("id") or sk, row.get("metaGame")
            if not isinstance(game_id, str) or not isinstance(meta, str) or not meta:
                continue
            players = row.get(r.PLAYERS)
            ids = tuple(
                str(p.get(r.PLAYER_ID, "")) if isinstance(p, dict) else ""
                for p in (players if isinstance(players, list) else [])
            )
            games.append(CurrentGame(game_id, meta, ids, _to_move(row.get("toMove"))))
        return games

    def _game_from_row(self, row: Row, sk: str) -> CurrentGame | None:
        game_id, meta = row.get("id") or sk, row.get(r.META_GAME)
        if not isinstance(game_id, str) or not isinstance(meta, str) or not meta:
            return None
        players = row.get(r.PLAYERS)
        ids = tuple(
            str(p.get(r.PLAYER_ID, "")) if isinstance(p, dict) else ""
            for p in (players if isinstance(players, list) else [])
        )
        return CurrentGame(game_id, meta, ids, _to_move(row.get("toMove")))

    async def add_bot_candidates(
        self, candidates: Sequence[tuple[str, str, str]], now_ms: int
    ) -> None:
        for bot_id, meta, game_id in candidates:
            self._rows[(r.BOTTURNS_PREFIX + bot_id, game_id)] = {
                r.META_GAME: meta,
                r.ADDED_AT: now_ms,
                r.TTL: now_ms // 1000 + BOT_CANDIDATE_TTL_SECONDS,
            }

    async def bot_candidates(self, bot_id: str) -> list[BotCandidate]:
        pk = r.BOTTURNS_PREFIX + bot_id
        return [
            BotCandidate(sk, str(row[r.META_GAME]), int(row.get(r.ADDED_AT, 0)))
            for (row_pk, sk), row in sorted(self._rows.items())
            if row_pk == pk and row.get(r.META_GAME)
        ]

    async def drop_bot_candidate(self, bot_id: str, game_id: str, added_at_ms: int) -> bool:
        key = (r.BOTTURNS_PREFIX + bot_id, game_id)
        row = self._rows.get(key)
        if row is None or row.get(r.ADDED_AT) != added_at_ms:
            return False
        del self._rows[key]
        return True

    async def active_games(self, keys: Sequence[tuple[str, str]]) -> dict[str, CurrentGame]:
        games: dict[str, CurrentGame] = {}
        for meta, game_id in keys:
            sk = r.game_sk(meta, game_id, completed=False)
            row = self._rows.get((r.GAME_PK, sk))
            game = self._game_from_row(row, game_id) if row is not None else None
            if game is not None:
                games[game.game_id] = game
        return games

    def put_game(self, game: CurrentGame, completed: bool = False) -> None:
        """Seed a ``GAME`` row as the backend writes it (the fields routing reads)."""
        to_move = list(game.to_move) if isinstance(game.to_move, tuple) else game.to_move
        self.put_row(
            r.GAME_PK,
            r.game_sk(game.meta, game.game_id, completed),
            {
                "id": game.game_id,
                r.META_GAME: game.meta,
                r.PLAYERS: [{r.PLAYER_ID: p, "name": p, "time": 0} for p in game.player_ids],
                "toMove": to_move if to_move is not None else "",
            },
        )

    def put_bot(self, bot: BotRecord) -> None:
        """Seed a ``BOT`` row as the backend's ``create_bot`` writes it."""
        self.put_row(r.BOT_PK, bot.client_id, {"name": bot.name, "owner": bot.owner})

    def put_current_game(self, user_id: str, game: CurrentGame) -> None:
        """Seed a ``CURRENTGAMES#`` row as the backend's game projector writes it."""
        to_move = list(game.to_move) if isinstance(game.to_move, tuple) else game.to_move
        self.put_row(
            r.CURRENTGAMES_PREFIX + user_id,
            game.game_id,
            {
                "id": game.game_id,
                "metaGame": game.meta,
                r.PLAYERS: [{r.PLAYER_ID: player} for player in game.player_ids],
                "toMove": to_move,
            },
        )

    # --- game-side records ----------------------------------------------------

    async def get_game_access(self, meta: str, game_id: str) -> GameAccess:
        active = self._rows.get((r.GAME_PK, r.game_sk(meta, game_id, completed=False)))
        if active is not None:
            players = active.get(r.PLAYERS)
            ids = tuple(
                str(p[r.PLAYER_ID])
                for p in (players if isinstance(players, list) else [])
                if isinstance(p, dict) and isinstance(p.get(r.PLAYER_ID), str)
            )
            return GameAccess(GameStatus.ACTIVE, ids)
        if (r.GAME_PK, r.game_sk(meta, game_id, completed=True)) in self._rows:
            return GameAccess(GameStatus.COMPLETED)
        return GameAccess(GameStatus.MISSING)

    async def is_admin(self, user_id: str) -> bool:
        row = self._rows.get((r.USER_PK, user_id))
        return row is not None and row.get(r.ADMIN) is True

    async def append_comment(self, game_id: str, comment: StoredComment, key: str) -> AppendOutcome:
        # No await inside: on one event loop this is as atomic as the conditional UpdateItem.
        row = self._rows.get((r.GAMECOMMENTS_PK, game_id), {})
        comments = row.get(r.COMMENTS)
        comments = comments if isinstance(comments, list) else []
        ids = row.get(r.COMMENT_IDS)
        ids = ids if isinstance(ids, dict) else {}
        if key in ids:
            return AppendOutcome(AppendStatus.DUPLICATE, int(ids[key]))
        total = row.get(r.COMMENT_BYTES)
        if not isinstance(total, int):
            total = sum(comment_weight(str(c.get(r.COMMENT, ""))) for c in comments)
        weight = comment_weight(comment.comment)
        if total + weight >= COMMENTS_CAP_BYTES:
            return AppendOutcome(AppendStatus.FULL)
        comments.append(comment.to_plain())
        ids[key] = comment.time_stamp
        row[r.COMMENTS] = comments
        row[r.COMMENT_BYTES] = total + weight
        row[r.COMMENT_IDS] = ids
        self._rows[(r.GAMECOMMENTS_PK, game_id)] = row
        return AppendOutcome(AppendStatus.STORED, comment.time_stamp)

    async def append_comments(
        self, game_id: str, entries: Sequence[tuple[StoredComment, str]]
    ) -> list[AppendOutcome]:
        return [await self.append_comment(game_id, comment, key) for comment, key in entries]

    async def game_watchers(self, game_id: str) -> list[str]:
        pk = r.GAMEWATCHERS_PREFIX + game_id
        return sorted(sk for (row_pk, sk) in self._rows if row_pk == pk)

    async def mark_players_last_chat(
        self, game_id: str, players: Sequence[str], authors: Mapping[str, int]
    ) -> None:
        if not authors:
            return  # no comment, nothing to mark
        at_ms = max(authors.values())
        for player in players:
            if (r.BOT_PK, player) in self._rows:
                continue
            if (r.CURRENTGAMES_PREFIX + player, game_id) not in self._rows:
                continue
            row = self._rows.setdefault((r.USERGAME_PREFIX + player, game_id), {})
            _mark(row, at_ms, authors.get(player))

    async def mark_watchers_last_chat(
        self, game_id: str, watchers: Sequence[str], authors: Mapping[str, int]
    ) -> None:
        if not authors:
            return
        at_ms = max(authors.values())
        for watcher in watchers:
            row = self._rows.get((r.WATCHED_PREFIX + watcher, game_id))
            if row is not None:
                _mark(row, at_ms, authors.get(watcher))

    async def touch_last_seen(self, user_id: str, now_ms: int) -> bool:
        row = self._rows.get((r.USERS_PK, user_id))
        if row is None:
            return False
        last = row.get(r.LAST_SEEN)
        if isinstance(last, int | float) and last >= now_ms - r.LAST_SEEN_INTERVAL_MS:
            return False
        row[r.LAST_SEEN] = now_ms
        return True

    async def touch_last_seen_many(self, touches: Mapping[str, int]) -> set[str]:
        return {user for user, at in touches.items() if await self.touch_last_seen(user, at)}


def _mark(row: Row, at_ms: int, own: int | None) -> None:
    """Set ``lastChat`` (and, for an author, ``seen`` after their ``own`` comment)
    unless a newer mark is there."""
    last = row.get(r.LAST_CHAT)
    if isinstance(last, int | float) and last >= at_ms:
        return
    row[r.LAST_CHAT] = at_ms
    if own is not None:
        row[r.SEEN] = own + r.AUTHOR_SEEN_LEAD_MS


def _to_move(value: Any) -> ToMove:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return tuple(bool(flag) for flag in value)
    return None
