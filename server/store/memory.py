"""In-memory store: the embedded default, and the reference for the contract."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from server.store.base import (
    ConnectionRecord,
    Fenced,
    ShardCheckpoint,
    StreamReaderState,
)


class MemoryStore:
    """A process-local store with the same semantics as the DynamoDB one."""

    def __init__(self) -> None:
        self._connections: dict[str, ConnectionRecord] = {}
        self._presence_seq = 0
        self._reader: tuple[str, int, int] | None = None  # stream arn, started at, fence
        self._checkpoints: dict[
            str, tuple[str, ShardCheckpoint, int]
        ] = {}  # shard -> (arn, .., fence)

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
