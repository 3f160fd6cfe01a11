"""The Store contract for the game-side records (chat, marks, lastSeen), on memory and moto.

Rows are seeded and read back with ``tests.rows.Rows``: plain boto3 for DynamoDB.
"""

from __future__ import annotations

import asyncio

from protocol.chat import COMMENTS_CAP_BYTES, comment_weight
from server.store import Store
from server.store import records as r
from server.store.base import BOT_CANDIDATE_TTL_SECONDS
from server.store.memory import MemoryStore
from server.store.records import (
    AppendOutcome,
    AppendStatus,
    GameStatus,
    StoredComment,
    comment_key,
)
from tests.rows import Rows

GAME = "g1"


def comment(
    text: str, user: str = "alice", ts: int = 1_700_000_000_000, move: int = 3
) -> StoredComment:
    return StoredComment(comment=text, user_id=user, move_number=move, time_stamp=ts)


def plain(c: StoredComment) -> dict[str, object]:
    return c.to_plain()


# ------------------------------------------------------------------- authorization


async def test_game_access_reads_active_completed_and_missing_games(store: Store) -> None:
    rows = Rows(store)
    rows.put(
        "GAME",
        "chess#0#g1",
        {
            "players": [{"id": "alice", "name": "A"}, {"id": "bob", "name": "B"}],
            "state": "x" * 5000,
        },
    )
    rows.put("GAME", "chess#1#g2", {"players": [{"id": "alice", "name": "A"}]})
    active = await store.get_game_access("chess", "g1")
    assert active.status is GameStatus.ACTIVE and active.players == ("alice", "bob")
    completed = await store.get_game_access("chess", "g2")
    assert completed.status is GameStatus.COMPLETED and completed.players == ()
    assert (await store.get_game_access("chess", "nope")).status is GameStatus.MISSING
    assert (await store.get_game_access("go", "g1")).status is GameStatus.MISSING


async def test_is_admin_needs_a_true_admin_flag(store: Store) -> None:
    rows = Rows(store)
    rows.put("USER", "root", {"admin": True, "name": "Root"})
    rows.put("USER", "plain", {"admin": False})
    rows.put("USER", "stringy", {"admin": "true"})
    rows.put("USER", "none", {"name": "N"})
    assert await store.is_admin("root")
    for user in ("plain", "stringy", "none", "missing"):
        assert not await store.is_admin(user)


# ------------------------------------------------------------------------- append


async def test_appends_create_the_item_and_keep_order_and_counter(store: Store) -> None:
    first, second = comment("hello", ts=1), comment("second ✓", user="bob", ts=2)
    outcome = await store.append_comment(GAME, first, comment_key("alice", "m1"))
    assert outcome.status is AppendStatus.STORED and outcome.time_stamp == 1
    assert (await store.append_comment(GAME, second, comment_key("bob", "m1"))).status is (
        AppendStatus.STORED
    )
    row = Rows(store).get("GAMECOMMENTS", GAME)
    assert row is not None
    assert row["comments"] == [plain(first), plain(second)]
    assert row[r.COMMENT_BYTES] == comment_weight("hello") + comment_weight("second ✓")


async def test_a_repeated_key_is_stored_once_and_answers_the_first_time_stamp(
    store: Store,
) -> None:
    key = comment_key("alice", "retry-me")
    assert (await store.append_comment(GAME, comment("once", ts=10), key)).status is (
        AppendStatus.STORED
    )
    again = await store.append_comment(GAME, comment("once", ts=99), key)
    assert again.status is AppendStatus.DUPLICATE and again.time_stamp == 10
    row = Rows(store).get("GAMECOMMENTS", GAME)
    assert row is not None and len(row["comments"]) == 1
    assert row[r.COMMENT_BYTES] == comment_weight("once")


async def test_an_item_without_a_counter_is_counted_on_its_first_append(store: Store) -> None:
    rows = Rows(store)
    old = [comment("old one", ts=1), comment("ünïcödé", user="bob", ts=2)]
    rows.put("GAMECOMMENTS", GAME, {"comments": [plain(c) for c in old], "other": "kept"})
    new = comment("new", ts=3)
    assert (await store.append_comment(GAME, new, comment_key("alice", "n"))).status is (
        AppendStatus.STORED
    )
    row = rows.get("GAMECOMMENTS", GAME)
    assert row is not None
    assert row["comments"] == [plain(c) for c in [*old, new]]
    assert row[r.COMMENT_BYTES] == sum(comment_weight(c.comment) for c in [*old, new])
    assert row["other"] == "kept"


async def test_a_near_cap_item_without_a_counter_is_refused_unchanged(store: Store) -> None:
    # A real near-cap item: 90 long comments, about 354 KB. Nothing is appended to it
    # here (moto counts an updated list twice against 400 KB, and is slow with
    # thousands of short elements), so the count happens and the refusal leaves it be.
    # The exact boundary is in the next test, and a counterless item that fits in
    # test_an_item_without_a_counter_is_counted_on_its_first_append.
    rows = Rows(store)
    long_text = "x" * 3886  # weight 3996; 90 of them weigh 359,640
    legacy = [
        {"comment": long_text, "userId": "u" * 36, "moveNumber": i, "timeStamp": 1_700_000_000_000}
        for i in range(90)
    ]
    rows.put("GAMECOMMENTS", GAME, {"comments": legacy})
    too_big = comment("y" * 250, ts=5)  # weight 360: the total would reach 360,000
    full = await store.append_comment(GAME, too_big, comment_key("alice", "big"))
    assert full.status is AppendStatus.FULL
    assert rows.get("GAMECOMMENTS", GAME) == {"comments": legacy}


async def test_a_counted_item_refuses_what_would_reach_the_cap(store: Store) -> None:
    rows = Rows(store)
    counted = {
        "comments": [plain(comment("a", ts=1)), plain(comment("b", ts=2))],
        r.COMMENT_BYTES: 359_700,  # as if many more had been counted
        r.COMMENT_IDS: {"k1": 1, "k2": 2},
    }
    rows.put("GAMECOMMENTS", GAME, counted)
    full = await store.append_comment(GAME, comment("y" * 190, ts=5), comment_key("a", "1"))
    assert full.status is AppendStatus.FULL  # 359,700 + 300 reaches 360,000
    assert rows.get("GAMECOMMENTS", GAME) == counted
    fits = comment("z" * 189, ts=6)
    assert (await store.append_comment(GAME, fits, comment_key("a", "2"))).status is (
        AppendStatus.STORED
    )
    row = rows.get("GAMECOMMENTS", GAME)
    assert row is not None and row[r.COMMENT_BYTES] == COMMENTS_CAP_BYTES - 1
    assert row["comments"][-1] == plain(fits)
    full_now = await store.append_comment(GAME, comment("!", ts=7), comment_key("a", "3"))
    assert full_now.status is AppendStatus.FULL
    assert rows.get("GAMECOMMENTS", GAME) == row


async def test_appends_from_many_writers_are_each_stored_once(store: Store) -> None:
    posts = [comment(f"c{i}", user=f"u{i % 5}", ts=i) for i in range(40)]
    # moto's threaded server does not apply UpdateItem atomically (two updates of one
    # item may race and one be lost), which DynamoDB does; so on moto the writers take
    # turns, and only the memory store is driven truly at once. In the service the
    # per-game lock serializes them anyway.
    at_once = 40 if isinstance(store, MemoryStore) else 1
    gate = asyncio.Semaphore(at_once)

    async def write(i: int, c: StoredComment) -> AppendOutcome:
        async with gate:
            return await store.append_comment(GAME, c, comment_key(c.user_id, f"m{i}"))

    outcomes = await asyncio.gather(*(write(i, c) for i, c in enumerate(posts)))
    assert all(o.status is AppendStatus.STORED for o in outcomes)
    row = Rows(store).get("GAMECOMMENTS", GAME)
    assert row is not None
    assert sorted(c["comment"] for c in row["comments"]) == sorted(c.comment for c in posts)
    assert row[r.COMMENT_BYTES] == sum(comment_weight(c.comment) for c in posts)


async def test_a_batch_is_stored_as_if_its_comments_came_one_by_one(store: Store) -> None:
    key = comment_key
    # The game's first comments: the item does not exist yet.
    first = [comment("one", ts=1), comment("two", user="bob", ts=2)]
    outcomes = await store.append_comments(
        GAME, [(first[0], key("alice", "1")), (first[1], key("bob", "1"))]
    )
    assert [(o.status, o.time_stamp) for o in outcomes] == [
        (AppendStatus.STORED, 1),
        (AppendStatus.STORED, 2),
    ]
    # The usual case: an item with its counter, new keys only.
    more = [comment(f"c{i} ✓", user=f"u{i}", ts=10 + i) for i in range(5)]
    outcomes = await store.append_comments(GAME, [(c, key(c.user_id, "m")) for c in more])
    assert [o.status for o in outcomes] == [AppendStatus.STORED] * 5
    assert [o.time_stamp for o in outcomes] == [10, 11, 12, 13, 14]
    # A retry of a stored key among new ones, and one key twice in the batch.
    retry = comment("two again", user="bob", ts=20)
    fresh = comment("fresh", ts=21)
    twice = comment("fresh, sent twice", ts=22)
    outcomes = await store.append_comments(
        GAME, [(retry, key("bob", "1")), (fresh, key("alice", "2")), (twice, key("alice", "2"))]
    )
    assert [(o.status, o.time_stamp) for o in outcomes] == [
        (AppendStatus.DUPLICATE, 2),
        (AppendStatus.STORED, 21),
        (AppendStatus.DUPLICATE, 21),
    ]
    row = Rows(store).get("GAMECOMMENTS", GAME)
    assert row is not None
    kept = [*first, *more, fresh]
    assert row["comments"] == [plain(c) for c in kept]
    assert row[r.COMMENT_BYTES] == sum(comment_weight(c.comment) for c in kept)
    assert len(row[r.COMMENT_IDS]) == len(kept)


async def test_a_batch_that_would_pass_the_cap_stores_what_fits_in_order(store: Store) -> None:
    rows = Rows(store)
    counted = {
        "comments": [plain(comment("a", ts=1))],
        r.COMMENT_BYTES: 359_400,
        r.COMMENT_IDS: {"k1": 1},
    }
    rows.put("GAMECOMMENTS", GAME, counted)
    fits = comment("x" * 190, ts=2)  # weight 300: 359,700
    too_big = comment("y" * 290, ts=3)  # weight 400: would reach 360,100
    small = comment("z" * 189, ts=4)  # weight 299: 359,999 still fits
    outcomes = await store.append_comments(
        GAME,
        [
            (fits, comment_key("a", "1")),
            (too_big, comment_key("a", "2")),
            (small, comment_key("a", "3")),
        ],
    )
    assert [o.status for o in outcomes] == [
        AppendStatus.STORED,
        AppendStatus.FULL,
        AppendStatus.STORED,
    ]
    row = rows.get("GAMECOMMENTS", GAME)
    assert row is not None
    assert row["comments"][1:] == [plain(fits), plain(small)]
    assert row[r.COMMENT_BYTES] == COMMENTS_CAP_BYTES - 1


async def test_a_large_batch_keeps_its_order(store: Store) -> None:
    posts = [comment(f"n{i}", user=f"u{i % 3}", ts=i) for i in range(95)]
    await store.append_comment(GAME, comment("first", ts=0), comment_key("x", "0"))
    outcomes = await store.append_comments(
        GAME, [(c, comment_key(c.user_id, f"m{i}")) for i, c in enumerate(posts)]
    )
    assert all(o.status is AppendStatus.STORED for o in outcomes)
    row = Rows(store).get("GAMECOMMENTS", GAME)
    assert row is not None
    assert [c["comment"] for c in row["comments"]] == ["first", *(c.comment for c in posts)]


# -------------------------------------------------------------------------- marks


async def test_game_watchers_lists_the_reverse_index(store: Store) -> None:
    rows = Rows(store)
    for user in ("w2", "w1"):
        rows.put(f"GAMEWATCHERS#{GAME}", user)
    rows.put("GAMEWATCHERS#other", "w9")
    assert sorted(await store.game_watchers(GAME)) == ["w1", "w2"]
    assert await store.game_watchers("nobody-watches") == []


async def test_player_marks_follow_the_dashboard_rows(store: Store) -> None:
    rows = Rows(store)
    for player in ("alice", "bob", "botty"):
        rows.put(f"CURRENTGAMES#{player}", GAME, {"id": GAME})
    rows.put("BOT", "botty", {"name": "Botty"})
    rows.put("USERGAME#bob", GAME, {"seen": 5, "other": 1})
    await store.mark_players_last_chat(GAME, ["alice", "bob"], {})  # no comment: no mark
    assert rows.get("USERGAME#alice", GAME) is None
    await store.mark_players_last_chat(GAME, ["alice", "bob", "botty", "carol"], {"alice": 1000})
    assert rows.get("USERGAME#alice", GAME) == {"lastChat": 1000, "seen": 1010}
    assert rows.get("USERGAME#bob", GAME) == {"lastChat": 1000, "seen": 5, "other": 1}
    assert rows.get("USERGAME#botty", GAME) is None  # bots have no dashboard
    assert rows.get("USERGAME#carol", GAME) is None  # not on carol's dashboard


async def test_watcher_marks_update_existing_rows_only(store: Store) -> None:
    rows = Rows(store)
    rows.put("WATCHED#w1", GAME, {"metaGame": "chess", "addedAt": 1, "seen": 2})
    rows.put("WATCHED#admin", GAME, {"metaGame": "chess"})
    await store.mark_watchers_last_chat(GAME, ["w1"], {})  # no comment: no mark
    assert rows.get("WATCHED#w1", GAME) == {"metaGame": "chess", "addedAt": 1, "seen": 2}
    await store.mark_watchers_last_chat(GAME, ["w1", "admin", "gone"], {"admin": 500})
    assert rows.get("WATCHED#w1", GAME) == {
        "metaGame": "chess",
        "addedAt": 1,
        "seen": 2,
        "lastChat": 500,
    }
    assert rows.get("WATCHED#admin", GAME) == {"metaGame": "chess", "lastChat": 500, "seen": 510}
    assert rows.get("WATCHED#gone", GAME) is None


async def test_an_older_mark_never_overwrites_a_newer_one(store: Store) -> None:
    rows = Rows(store)
    rows.put("CURRENTGAMES#alice", GAME, {"id": GAME})
    rows.put("WATCHED#w1", GAME, {"addedAt": 1})
    await store.mark_players_last_chat(GAME, ["alice"], {"alice": 2000})
    await store.mark_watchers_last_chat(GAME, ["w1"], {"w1": 2000})
    await store.mark_players_last_chat(GAME, ["alice"], {"bob": 1000})  # a late retry
    await store.mark_watchers_last_chat(GAME, ["w1"], {"bob": 1000})
    assert rows.get("USERGAME#alice", GAME) == {"lastChat": 2000, "seen": 2010}
    assert rows.get("WATCHED#w1", GAME) == {"addedAt": 1, "lastChat": 2000, "seen": 2010}


async def test_one_mark_for_several_authors_keeps_each_authors_seen(store: Store) -> None:
    # A flush's comments by several authors: every row gets the latest time, each
    # author's row their own seen, in one write per row.
    rows = Rows(store)
    for player in ("alice", "bob", "carol"):
        rows.put(f"CURRENTGAMES#{player}", GAME, {"id": GAME})
    rows.put("WATCHED#w1", GAME, {"addedAt": 1})
    rows.put("WATCHED#w2", GAME, {"addedAt": 1})
    authors = {"alice": 3000, "bob": 1000, "w1": 2000}
    await store.mark_players_last_chat(GAME, ["alice", "bob", "carol"], authors)
    await store.mark_watchers_last_chat(GAME, ["w1", "w2"], authors)
    assert rows.get("USERGAME#alice", GAME) == {"lastChat": 3000, "seen": 3010}
    assert rows.get("USERGAME#bob", GAME) == {"lastChat": 3000, "seen": 1010}
    assert rows.get("USERGAME#carol", GAME) == {"lastChat": 3000}
    assert rows.get("WATCHED#w1", GAME) == {"addedAt": 1, "lastChat": 3000, "seen": 2010}
    assert rows.get("WATCHED#w2", GAME) == {"addedAt": 1, "lastChat": 3000}


# ----------------------------------------------------------------------- lastSeen


async def test_last_seen_is_written_when_missing_or_stale_only(store: Store) -> None:
    rows = Rows(store)
    rows.put("USERS", "fresh", {"name": "F"})
    rows.put("USERS", "recent", {"name": "R", "lastSeen": 1_000_000})
    rows.put("USERS", "stale", {"name": "S", "lastSeen": 1_000_000})
    quarter = r.LAST_SEEN_INTERVAL_MS
    assert await store.touch_last_seen("fresh", 2_000_000)
    assert rows.get("USERS", "fresh") == {"name": "F", "lastSeen": 2_000_000}
    assert not await store.touch_last_seen("recent", 1_000_000 + quarter)
    assert rows.get("USERS", "recent") == {"name": "R", "lastSeen": 1_000_000}
    assert await store.touch_last_seen("stale", 1_000_001 + quarter)
    assert rows.get("USERS", "stale") == {"name": "S", "lastSeen": 1_000_001 + quarter}
    assert not await store.touch_last_seen("ghost", 5_000_000)
    assert rows.get("USERS", "ghost") is None


async def test_last_seen_in_batches_keeps_the_same_rules(store: Store) -> None:
    """60 users (three requests' worth on DynamoDB), conditions failing in every chunk:
    the rest of each chunk is written all the same."""
    rows = Rows(store)
    quarter = r.LAST_SEEN_INTERVAL_MS
    now = 10 * quarter
    touches: dict[str, int] = {}
    expected: set[str] = set()
    for index in range(60):
        user = f"u{index:02d}"
        touches[user] = now + index
        match index % 4:
            case 0:
                rows.put("USERS", user, {"name": user})  # never seen: written
                expected.add(user)
            case 1:
                rows.put("USERS", user, {"name": user, "lastSeen": now - quarter})  # stale
                expected.add(user)
            case 2:
                rows.put("USERS", user, {"name": user, "lastSeen": now - 10})  # recent
            case _:
                pass  # no USERS row: nothing is created
    assert await store.touch_last_seen_many(touches) == expected
    for index in range(60):
        user = f"u{index:02d}"
        row = rows.get("USERS", user)
        match index % 4:
            case 0 | 1:
                assert row == {"name": user, "lastSeen": now + index}
            case 2:
                assert row == {"name": user, "lastSeen": now - 10}
            case _:
                assert row is None
    assert await store.touch_last_seen_many({}) == set()
    assert await store.touch_last_seen_many({"u02": now + 1}) == set()


# ------------------------------------------------------------- a bot's candidates


async def test_bot_candidates_are_upserted_listed_and_pruned_unless_re_added(
    store: Store,
) -> None:
    moves = [("bot1", "chess", "g1"), ("bot1", "chess", "g2"), ("bot2", "go", "g3")]
    # A repeat in one batch (one message re-sent) is one row.
    await store.add_bot_candidates([*moves, ("bot1", "chess", "g1")], 1_000)
    found = await store.bot_candidates("bot1")
    assert [(c.game_id, c.meta, c.added_at_ms) for c in found] == [
        ("g1", "chess", 1_000),
        ("g2", "chess", 1_000),
    ]
    row = Rows(store).get(r.BOTTURNS_PREFIX + "bot2", "g3")
    assert row is not None
    assert row[r.META_GAME] == "go" and int(row[r.ADDED_AT]) == 1_000
    assert int(row[r.TTL]) == 1 + BOT_CANDIDATE_TTL_SECONDS
    # Re-sent later: addedAt moves, so a prune that read the older row keeps it.
    await store.add_bot_candidates([("bot1", "chess", "g1")], 2_000)
    assert not await store.drop_bot_candidate("bot1", "g1", 1_000)
    assert await store.drop_bot_candidate("bot1", "g2", 1_000)
    assert [c.game_id for c in await store.bot_candidates("bot1")] == ["g1"]


async def test_a_batch_of_candidates_past_one_request_is_written_whole(store: Store) -> None:
    moves = [(f"bot{i % 3}", "chess", f"g{i:02d}") for i in range(60)]
    await store.add_bot_candidates(moves, 5_000)
    listed = [await store.bot_candidates(f"bot{b}") for b in range(3)]
    assert sorted(c.game_id for found in listed for c in found) == [f"g{i:02d}" for i in range(60)]
