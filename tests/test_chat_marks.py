"""The dashboard marks' write-behind: one write per row per flush, whoever commented."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from server.services.chat_marks import ChatMarks
from server.store.memory import MemoryStore
from tests.rows import Rows

GAME = "g1"


class CountingStore(MemoryStore):
    """The embedded store, recording each mark call's authors."""

    def __init__(self) -> None:
        super().__init__()
        self.player_marks: list[dict[str, int]] = []
        self.watcher_marks: list[dict[str, int]] = []
        self.fail_next = 0

    async def mark_players_last_chat(
        self, game_id: str, players: Sequence[str], authors: Mapping[str, int]
    ) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("DynamoDB away")
        self.player_marks.append(dict(authors))
        await super().mark_players_last_chat(game_id, players, authors)

    async def mark_watchers_last_chat(
        self, game_id: str, watchers: Sequence[str], authors: Mapping[str, int]
    ) -> None:
        self.watcher_marks.append(dict(authors))
        await super().mark_watchers_last_chat(game_id, watchers, authors)


def seeded() -> tuple[CountingStore, Rows]:
    store = CountingStore()
    rows = Rows(store)
    for player in ("alice", "bob"):
        rows.put(f"CURRENTGAMES#{player}", GAME, {"id": GAME})
    rows.put(f"GAMEWATCHERS#{GAME}", "spec")
    rows.put("WATCHED#spec", GAME, {"addedAt": 5})
    return store, rows


async def test_several_authors_in_one_flush_write_each_row_once() -> None:
    store, rows = seeded()
    marks = ChatMarks(store)
    # Queued before the flusher starts: all in its first flush.
    marks.queue(GAME, ["alice", "bob"], "alice", 1000)
    marks.queue(GAME, ["alice", "bob"], "bob", 2000)
    marks.queue(GAME, ["alice", "bob"], "alice", 3000)
    marks.queue(GAME, ["alice", "bob"], "spec", 2500)
    marks.start()
    try:
        await marks.drained()
    finally:
        await marks.close()
    authors = {"alice": 3000, "bob": 2000, "spec": 2500}
    assert store.player_marks == [authors]
    assert store.watcher_marks == [authors]
    assert rows.get("USERGAME#alice", GAME) == {"lastChat": 3000, "seen": 3010}
    assert rows.get("USERGAME#bob", GAME) == {"lastChat": 3000, "seen": 2010}
    assert rows.get("WATCHED#spec", GAME) == {"addedAt": 5, "lastChat": 3000, "seen": 2510}


async def test_a_failed_flush_is_retried_with_what_came_meanwhile() -> None:
    store, rows = seeded()
    store.fail_next = 1
    marks = ChatMarks(store)
    marks.queue(GAME, ["alice", "bob"], "alice", 1000)
    marks.start()
    try:
        await marks.drained()
        marks.queue(GAME, ["alice", "bob"], "bob", 2000)
        await marks.drained()
    finally:
        await marks.close()
    assert store.fail_next == 0  # the first write failed, and was retried
    assert rows.get("USERGAME#alice", GAME) == {"lastChat": 2000, "seen": 1010}
    assert rows.get("USERGAME#bob", GAME) == {"lastChat": 2000, "seen": 2010}
