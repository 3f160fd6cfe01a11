"""In-memory store: the embedded default, and the reference for the contract."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from server.store.base import BotRecord, ConnectionRecord, CurrentGame


class MemoryStore:
    """A process-local store with the same semantics as the DynamoDB one."""

    def __init__(self) -> None:
        self._connections: dict[str, ConnectionRecord] = {}
        self._presence_seq = 0
        self._bots: dict[str, BotRecord] = {}
        self._current_games: dict[str, dict[str, CurrentGame]] = {}

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

    async def next_presence_seq(self) -> int:
        self._presence_seq += 1
        return self._presence_seq

    async def current_presence_seq(self) -> int:
        return self._presence_seq

    async def get_bot(self, client_id: str) -> BotRecord | None:
        return self._bots.get(client_id)

    async def current_games(self, user_id: str) -> list[CurrentGame]:
        games = self._current_games.get(user_id, {})
        return [games[game_id] for game_id in sorted(games)]

    # The backend writes these rows; the embedded default and tests seed them here.

    def put_bot(self, bot: BotRecord) -> None:
        self._bots[bot.client_id] = bot

    def put_current_game(self, user_id: str, game: CurrentGame) -> None:
        self._current_games.setdefault(user_id, {})[game.game_id] = game

    def delete_current_game(self, user_id: str, game_id: str) -> None:
        self._current_games.get(user_id, {}).pop(game_id, None)
