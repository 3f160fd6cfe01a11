"""Write-behind of the dashboard's chat marks, as the backend sets them after a comment.

Players' ``USERGAME#`` rows and watchers' ``WATCHED#`` rows get ``lastChat`` (the
author's ``seen`` too), so dashboards show "new chat". None of it is on the
author's path: the ack has gone before these are written. Failed writes are
retried with backoff; the store never lets an older mark overwrite a newer one,
so retries may land in any order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from server.runtime.metrics import Registry
from server.runtime.write_behind import CoalescingFlusher, WriteBehind
from server.store.base import Store


@dataclass(frozen=True, slots=True)
class MarkJob:
    players: tuple[str, ...]
    at_ms: int


def _newer(older: MarkJob, newer: MarkJob) -> MarkJob:
    return newer if newer.at_ms >= older.at_ms else older


class ChatMarks(WriteBehind[tuple[str, str], MarkJob]):
    def __init__(self, store: Store, metrics: Registry | None = None) -> None:
        registry = metrics or Registry()
        retries = registry.counter(
            "ap_chat_mark_retries_total", "Dashboard chat marks that failed and were queued again"
        )
        self._store = store
        # One pending job per (game, author): the author's own seen mark survives
        # another author's comment in the same flush.
        self._flusher: CoalescingFlusher[tuple[str, str], MarkJob] = CoalescingFlusher(
            "chat-marks", self._flush, _newer, retries
        )
        registry.gauge(
            "ap_chat_mark_backlog",
            "Dashboard chat marks waiting to be written",
            lambda: float(self._flusher.backlog),
        )

    def queue(self, game_id: str, players: Sequence[str], author: str, at_ms: int) -> None:
        self._flusher.put((game_id, author), MarkJob(tuple(players), at_ms))

    async def _flush(self, batch: dict[tuple[str, str], MarkJob]) -> dict[tuple[str, str], MarkJob]:
        failed: dict[tuple[str, str], MarkJob] = {}
        watchers_of: dict[str, list[str]] = {}
        for (game_id, author), job in batch.items():
            try:
                if game_id not in watchers_of:
                    watchers_of[game_id] = await self._store.game_watchers(game_id)
                await self._store.mark_players_last_chat(game_id, job.players, author, job.at_ms)
                await self._store.mark_watchers_last_chat(
                    game_id, watchers_of[game_id], author, job.at_ms
                )
            except Exception:
                failed[(game_id, author)] = job
        return failed
