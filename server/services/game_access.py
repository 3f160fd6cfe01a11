"""A game's chat authorization (its ``GAME`` row: active or not, and its players),
read once and shared, so the comments of a busy game do not each wait for a read.

- Only an active game is kept: its players never change, only whether it is over.
  Completed and unknown games are read for every comment (a game created a moment
  ago is found at once, an ended one is refused at once).
- An entry younger than ``fresh`` is used as it is. One younger than ``stale`` is
  used too, and read again behind the comment; one older is read again before the
  comment goes on. So every comment is judged on a read begun at most ``stale``
  seconds before it: a game that ends refuses comments within ``stale`` seconds on
  every node (a comment under way when it ends could always be stored).
- One read at a time per game: concurrent misses wait for the same read.
- At most ``size`` games are kept, the least recently read dropped first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from server.runtime.metrics import Registry
from server.runtime.tasks import cancel_all_and_wait
from server.store.records import GameAccess, GameStatus

log = logging.getLogger(__name__)

FRESH_SECONDS = 1.0
STALE_SECONDS = 5.0
MAX_GAMES = 10_000

Key = tuple[str, str]  # (metaGame, gameId)
ReadAccess = Callable[[str, str], Awaitable[GameAccess]]


class GameAccessCache:
    def __init__(
        self,
        read: ReadAccess,
        *,
        fresh: float = FRESH_SECONDS,
        stale: float = STALE_SECONDS,
        size: int = MAX_GAMES,
        clock: Callable[[], float] = time.monotonic,
        metrics: Registry | None = None,
    ) -> None:
        if not 0 <= fresh <= stale:
            raise ValueError(f"need 0 <= fresh <= stale, got fresh={fresh}, stale={stale}")
        registry = metrics or Registry()
        self._store_reads = registry.counter(
            "ap_chat_access_reads_total", "GAME row reads for chat authorization"
        )
        self._hits = registry.counter(
            "ap_chat_access_cached_total", "Chat authorizations answered from a kept GAME row"
        )
        self._read_access = read
        self._fresh = fresh
        self._stale = stale
        self._size = size
        self._clock = clock
        # Insertion order is read order: the first entry is the least recently read.
        self._entries: dict[Key, tuple[GameAccess, float]] = {}
        self._reads: dict[Key, asyncio.Task[GameAccess]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, meta: str, game_id: str) -> GameAccess:
        """The game's access, as of a read begun at most ``stale`` seconds ago
        (raises what the read raises)."""
        key = (meta, game_id)
        entry = self._entries.get(key)
        if entry is not None:
            access, read_at = entry
            age = self._clock() - read_at
            if age < self._stale:
                if age >= self._fresh:
                    self._read(key)  # behind this comment, for the next ones
                self._hits.inc()
                return access
        # Shielded: a caller that gives up does not cancel the others' read.
        return await asyncio.shield(self._read(key))

    def _read(self, key: Key) -> asyncio.Task[GameAccess]:
        task = self._reads.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch(key), name=f"game-access:{key[0]}#{key[1]}")
            self._reads[key] = task
            task.add_done_callback(lambda done: self._finished(key, done))
        return task

    async def _fetch(self, key: Key) -> GameAccess:
        started = self._clock()
        self._store_reads.inc()
        access = await self._read_access(*key)
        self._entries.pop(key, None)
        if access.status is GameStatus.ACTIVE:
            self._entries[key] = (access, started)  # aged from when the read began
            while len(self._entries) > self._size:
                del self._entries[next(iter(self._entries))]
        return access

    def _finished(self, key: Key, task: asyncio.Task[GameAccess]) -> None:
        if self._reads.get(key) is task:
            del self._reads[key]
        if not task.cancelled() and (exc := task.exception()) is not None:
            # A caller waiting for it has it too; a read behind a comment has none.
            log.info("GAME row read for %s#%s failed: %s", key[0], key[1], exc)

    async def close(self) -> None:
        await cancel_all_and_wait(list(self._reads.values()))
