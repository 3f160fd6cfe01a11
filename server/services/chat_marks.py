"""Write-behind of the dashboard's chat marks, as the backend sets them after a comment.

Players' ``USERGAME#`` rows and watchers' ``WATCHED#`` rows get ``lastChat`` (the
author's ``seen`` too), so dashboards show "new chat". None of it is on the
author's path: the ack has gone before these are written. A flush writes each of a
game's rows once, however many comments and authors it holds. Failed writes are
retried with backoff; the store never lets an older mark overwrite a newer one,
so retries may land in any order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from server.runtime.metrics import Registry
from server.runtime.write_behind import CoalescingFlusher, WriteBehind
from server.store.base import Store


@dataclass(frozen=True, slots=True)
class MarkJob:
    """A game's marks waiting to be written: its players as of the latest comment,
    and each author's latest comment (ms)."""

    players: tuple[str, ...]
    authors: Mapping[str, int]

    @property
    def latest(self) -> int:
        return max(self.authors.values())


def _merged(older: MarkJob, newer: MarkJob) -> MarkJob:
    authors = dict(older.authors)
    for author, at_ms in newer.authors.items():
        authors[author] = max(at_ms, authors.get(author, at_ms))
    players = newer.players if newer.latest >= older.latest else older.players
    return MarkJob(players, authors)


class ChatMarks(WriteBehind[str, MarkJob]):
    def __init__(self, store: Store, metrics: Registry | None = None) -> None:
        registry = metrics or Registry()
        retries = registry.counter(
            "ap_chat_mark_retries_total", "Dashboard chat marks that failed and were queued again"
        )
        self._store = store
        # One pending job per game, whatever number of authors: each row is written
        # once per flush, and each author's own seen mark is kept in the job.
        self._flusher: CoalescingFlusher[str, MarkJob] = CoalescingFlusher(
            "chat-marks", self._flush, _merged, retries
        )
        registry.gauge(
            "ap_chat_mark_backlog",
            "Dashboard chat marks waiting to be written",
            lambda: float(self._flusher.backlog),
        )

    def queue(self, game_id: str, players: Sequence[str], author: str, at_ms: int) -> None:
        self._flusher.put(game_id, MarkJob(tuple(players), {author: at_ms}))

    async def _flush(self, batch: dict[str, MarkJob]) -> dict[str, MarkJob]:
        failed: dict[str, MarkJob] = {}
        for game_id, job in batch.items():
            try:
                watchers = await self._store.game_watchers(game_id)
                await self._store.mark_players_last_chat(game_id, job.players, job.authors)
                await self._store.mark_watchers_last_chat(game_id, watchers, job.authors)
            except Exception:
                failed[game_id] = job
        return failed
