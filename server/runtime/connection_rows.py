"""Write-behind of ``wsConnections`` rows: nothing on a client's path waits on the store.

Operations on one connection coalesce while they wait (a put followed by a
watch update is still one put), then go out in batches, each behind the pacer
(``server/runtime/pacer.py``) so a connect storm's rows use the CPU fan-out
leaves over. Routing never reads these rows: they are the record for the
backend and operators.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass

from server.runtime.metrics import Registry
from server.runtime.pacer import Pacer
from server.runtime.write_behind import CoalescingFlusher, WriteBehind
from server.session import Session
from server.store.base import CONNECTION_TTL_SECONDS, ConnectionRecord, Store, ttl_from_now

UPDATE_CONCURRENCY = 16
ROWS_PER_WRITE = 25
"""Puts and deletes per store call: one BatchWriteItem's worth."""


@dataclass(frozen=True, slots=True)
class Put:
    record: ConnectionRecord


@dataclass(frozen=True, slots=True)
class Watch:
    games: frozenset[str]
    watch_version: int
    ttl: int


@dataclass(frozen=True, slots=True)
class Ttl:
    ttl: int


@dataclass(frozen=True, slots=True)
class Delete:
    pass


RowOp = Put | Watch | Ttl | Delete


def merge(older: RowOp, newer: RowOp) -> RowOp:
    """One operation with the effect of ``older`` then ``newer``."""
    if isinstance(newer, Delete | Put):
        return newer
    if isinstance(older, Delete):
        return older  # the connection is gone; a late update must not revive it
    if isinstance(older, Put):
        if isinstance(newer, Watch):
            return Put(
                dataclasses.replace(
                    older.record,
                    watching_games=newer.games,
                    watch_version=newer.watch_version,
                    ttl=newer.ttl,
                )
            )
        return Put(dataclasses.replace(older.record, ttl=newer.ttl))
    if isinstance(older, Watch) and isinstance(newer, Ttl):
        return dataclasses.replace(older, ttl=newer.ttl)
    return newer


class ConnectionRegistry(WriteBehind[str, RowOp]):
    def __init__(
        self, store: Store, metrics: Registry | None = None, pacer: Pacer | None = None
    ) -> None:
        registry = metrics or Registry()
        self._pacer = pacer or Pacer()
        failures = registry.counter(
            "ap_store_write_retries_total",
            "Connection row writes that failed and were queued again",
        )
        self._store = store
        self._flusher: CoalescingFlusher[str, RowOp] = CoalescingFlusher(
            "connection-rows", self._flush, merge, failures
        )
        registry.gauge(
            "ap_store_write_backlog",
            "Connection row operations waiting to be written",
            lambda: float(self._flusher.backlog),
        )

    async def keep_alive(self, sessions: Iterable[Session], interval: float) -> None:
        """Every ``interval``, push forward the ttl of the rows of ``sessions`` (a live
        set) that live longer than it; runs until cancelled."""
        while True:
            await asyncio.sleep(interval)
            horizon = time.time() + CONNECTION_TTL_SECONDS - interval * 2
            for session in list(sessions):
                if session.subscribed and session.row_ttl < horizon:
                    session.row_ttl = ttl_from_now()
                    self.refresh_ttl(session.connection_id, session.row_ttl)

    def rewrite(self, sessions: Iterable[Session], endpoint: str) -> None:
        """Write every subscribed session's row again: the cluster presumed this node
        (``endpoint``) dead and deleted them while it was only unreachable."""
        for session in sessions:
            if session.subscribed:
                self.put(session.row(endpoint))

    def put(self, record: ConnectionRecord) -> None:
        self._flusher.put(record.connection_id, Put(record))

    def watch(
        self, connection_id: str, games: frozenset[str], watch_version: int, ttl: int
    ) -> None:
        self._flusher.put(connection_id, Watch(games, watch_version, ttl))

    def refresh_ttl(self, connection_id: str, ttl: int) -> None:
        self._flusher.put(connection_id, Ttl(ttl))

    def delete(self, connection_id: str) -> None:
        self._flusher.put(connection_id, Delete())

    async def _flush(self, batch: dict[str, RowOp]) -> dict[str, RowOp]:
        """Puts and deletes in BatchWriteItem-sized chunks, updates in groups of
        ``UPDATE_CONCURRENCY``; each chunk and group waits its turn (``Pacer``)."""
        failed: dict[str, RowOp] = {}
        rows = [(cid, op) for cid, op in batch.items() if isinstance(op, Put | Delete)]
        for start in range(0, len(rows), ROWS_PER_WRITE):
            chunk = rows[start : start + ROWS_PER_WRITE]
            await self._pacer.turn()
            try:
                await self._store.write_connections(
                    [op.record for _, op in chunk if isinstance(op, Put)],
                    [cid for cid, op in chunk if isinstance(op, Delete)],
                )
            except Exception:
                failed.update(chunk)
        updates = [(cid, op) for cid, op in batch.items() if isinstance(op, Watch | Ttl)]

        async def update(cid: str, op: Watch | Ttl) -> None:
            try:
                if isinstance(op, Watch):
                    await self._store.update_watch(cid, op.games, op.watch_version, op.ttl)
                else:
                    await self._store.refresh_ttl(cid, op.ttl)
            except Exception:
                failed[cid] = op

        for start in range(0, len(updates), UPDATE_CONCURRENCY):
            await self._pacer.turn()
            group = updates[start : start + UPDATE_CONCURRENCY]
            await asyncio.gather(*(update(cid, op) for cid, op in group))
        return failed
