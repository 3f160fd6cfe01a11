"""The Store contract (``server/store/base.py``), run on every implementation.

Each test gets a fresh, started store from the ``store`` fixture: the memory
store, and DynamoDB (a moto server over HTTP, one table per test).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from protocol.errors import MAX_GAME_FIELD_CHARS, MAX_WATCHED_GAMES
from server.store import ConnectionRecord, Store, ttl_from_now
from server.store.base import Fenced, ShardCheckpoint


def record(
    connection_id: str,
    *,
    user_id: str = "user-1",
    invisible: bool = False,
    endpoint: str = "node-a",
    wants_presence: bool = True,
    watch_version: int | None = 1,
    watching_games: frozenset[str] = frozenset(),
    ttl: int | None = None,
) -> ConnectionRecord:
    return ConnectionRecord(
        connection_id=connection_id,
        user_id=user_id,
        invisible=invisible,
        endpoint=endpoint,
        wants_presence=wants_presence,
        watch_version=watch_version,
        watching_games=watching_games,
        ttl=ttl if ttl is not None else ttl_from_now(),
    )


def ids(records: list[ConnectionRecord]) -> set[str]:
    return {r.connection_id for r in records}


# ------------------------------------------------------------------------ puts


async def test_empty_store_has_nothing(store: Store) -> None:
    assert await store.list_connections() == []
    assert await store.get_connection("nobody") is None
    assert await store.current_presence_seq() == 0


async def test_put_then_get_round_trips_every_field(store: Store) -> None:
    rows = [
        record("full", watching_games=frozenset({"chess#1", "go#22"}), invisible=True),
        record("legacy", watch_version=None, watching_games=frozenset()),
        record("quiet", user_id="user-2", wants_presence=False, endpoint="node-b"),
        record("unicode", user_id="üser-✓", watching_games=frozenset({"jeu#é", "x#y#z"})),
    ]
    await store.write_connections(rows, [])
    for row in rows:
        assert await store.get_connection(row.connection_id) == row
    listed = await store.list_connections()
    assert sorted(listed, key=lambda r: r.connection_id) == sorted(
        rows, key=lambda r: r.connection_id
    )


async def test_put_replaces_the_whole_row(store: Store) -> None:
    await store.write_connections(
        [record("c1", watching_games=frozenset({"a#1"}), watch_version=1)], []
    )
    replacement = record("c1", user_id="user-9", watching_games=frozenset(), watch_version=None)
    await store.write_connections([replacement], [])
    assert await store.get_connection("c1") == replacement
    assert len(await store.list_connections()) == 1


async def test_largest_allowed_watch_set_round_trips(store: Store) -> None:
    # The protocol caps a watch set at MAX_WATCHED_GAMES keys of two
    # MAX_GAME_FIELD_CHARS fields: the biggest row must still fit in one item.
    half = MAX_GAME_FIELD_CHARS
    games = frozenset(
        f"{'m' * (half - 4)}{i:04d}#{'g' * (half - 4)}{i:04d}" for i in range(MAX_WATCHED_GAMES)
    )
    assert len(games) == MAX_WATCHED_GAMES
    assert all(len(game) == 2 * half + 1 for game in games)
    big = record("big", watching_games=games)
    await store.write_connections([big], [])
    assert await store.get_connection("big") == big
    # Via UpdateItem too. (From a small set: moto 5.2 wrongly adds the old
    # value's size to the new one, so big -> big fails there but not on AWS.)
    await store.update_watch("big", frozenset({"small#1"}), 1, big.ttl)
    await store.update_watch("big", games, 1, big.ttl + 1)
    fetched = await store.get_connection("big")
    assert fetched is not None and fetched.watching_games == games


def big_games(tag: str) -> frozenset[str]:
    """A maximal watch set (about 257 KB): a handful of rows pass DynamoDB's 1 MB page."""
    return frozenset(
        f"{tag}{i:04d}{'m' * (MAX_GAME_FIELD_CHARS - 10)}#{'g' * MAX_GAME_FIELD_CHARS}"
        for i in range(MAX_WATCHED_GAMES)
    )


async def test_list_and_endpoint_delete_read_every_page(store: Store) -> None:
    rows = [record(f"big-{i}", watching_games=big_games(f"t{i}")) for i in range(6)]
    other = record("other", endpoint="node-b")
    await store.write_connections([*rows, other], [])
    listed = await store.list_connections()
    assert ids(listed) == {r.connection_id for r in rows} | {"other"}
    assert {r.connection_id: r for r in listed}["big-5"] == rows[5]
    assert await store.delete_endpoint_connections("node-a") == 6
    assert ids(await store.list_connections()) == {"other"}


# --------------------------------------------------------------------- deletes


async def test_delete_removes_rows_and_ignores_missing_ids(store: Store) -> None:
    await store.write_connections([record("c1"), record("c2")], [])
    await store.write_connections([], ["c1", "never-existed"])
    assert await store.get_connection("c1") is None
    assert ids(await store.list_connections()) == {"c2"}


async def test_puts_and_deletes_in_one_call(store: Store) -> None:
    await store.write_connections([record("old1"), record("old2")], [])
    await store.write_connections([record("new1"), record("new2")], ["old1", "old2"])
    assert ids(await store.list_connections()) == {"new1", "new2"}


async def test_empty_write_is_a_no_op(store: Store) -> None:
    await store.write_connections([record("c1")], [])
    await store.write_connections([], [])
    assert ids(await store.list_connections()) == {"c1"}


async def test_batches_larger_than_25_are_written_completely(store: Store) -> None:
    rows = [
        record(f"conn-{i:03d}", user_id=f"user-{i % 9}", watching_games=frozenset({f"g#{i}"}))
        for i in range(60)
    ]
    await store.write_connections(rows, [])
    listed = await store.list_connections()
    assert len(listed) == 60
    assert {r.connection_id: r for r in listed} == {r.connection_id: r for r in rows}

    doomed = [f"conn-{i:03d}" for i in range(0, 60, 2)]  # 30 deletes: two batches
    fresh = [record(f"fresh-{i:03d}") for i in range(40)]
    await store.write_connections(fresh, doomed)
    remaining = ids(await store.list_connections())
    assert remaining == {f"conn-{i:03d}" for i in range(1, 60, 2)} | {
        r.connection_id for r in fresh
    }


# ------------------------------------------------------------------- updates


async def test_update_watch_replaces_games_version_and_ttl_only(store: Store) -> None:
    original = record(
        "c1",
        user_id="user-7",
        invisible=True,
        endpoint="node-z",
        wants_presence=False,
        watch_version=None,
        watching_games=frozenset({"old#1", "old#2"}),
    )
    await store.write_connections([original], [])
    new_ttl = original.ttl + 100
    await store.update_watch("c1", frozenset({"new#1"}), 1, new_ttl)
    assert await store.get_connection("c1") == dataclasses.replace(
        original, watching_games=frozenset({"new#1"}), watch_version=1, ttl=new_ttl
    )


async def test_update_watch_with_empty_set_clears_games(store: Store) -> None:
    await store.write_connections([record("c1", watching_games=frozenset({"a#1", "b#2"}))], [])
    await store.update_watch("c1", frozenset(), 1, ttl_from_now() + 5)
    fetched = await store.get_connection("c1")
    assert fetched is not None
    assert fetched.watching_games == frozenset()
    assert fetched.watch_version == 1
    # And a set can be given again after it was cleared.
    await store.update_watch("c1", frozenset({"c#3"}), 1, ttl_from_now())
    fetched = await store.get_connection("c1")
    assert fetched is not None and fetched.watching_games == frozenset({"c#3"})


async def test_refresh_ttl_changes_only_ttl(store: Store) -> None:
    original = record("c1", watching_games=frozenset({"a#1"}), invisible=True)
    await store.write_connections([original], [])
    await store.refresh_ttl("c1", original.ttl + 3600)
    assert await store.get_connection("c1") == dataclasses.replace(
        original, ttl=original.ttl + 3600
    )


async def test_updates_of_missing_rows_do_not_create_them(store: Store) -> None:
    await store.update_watch("ghost", frozenset({"a#1"}), 1, ttl_from_now())
    await store.update_watch("ghost-2", frozenset(), 1, ttl_from_now())
    await store.refresh_ttl("ghost-3", ttl_from_now())
    assert await store.get_connection("ghost") is None
    assert await store.get_connection("ghost-2") is None
    assert await store.get_connection("ghost-3") is None
    assert await store.list_connections() == []


async def test_late_updates_do_not_resurrect_a_deleted_row(store: Store) -> None:
    await store.write_connections([record("c1"), record("c2")], [])
    await store.write_connections([], ["c1"])
    await store.update_watch("c1", frozenset({"a#1"}), 1, ttl_from_now())
    await store.refresh_ttl("c1", ttl_from_now())
    assert await store.get_connection("c1") is None
    assert ids(await store.list_connections()) == {"c2"}


# ------------------------------------------------------------------------ ttl


async def test_rows_past_their_ttl_are_skipped(store: Store) -> None:
    now = int(time.time())
    await store.write_connections(
        [
            record("expired", ttl=now - 10),
            record("just-expired", ttl=now),
            record("live", ttl=now + 60),
        ],
        [],
    )
    assert await store.get_connection("expired") is None
    assert await store.get_connection("just-expired") is None
    assert await store.get_connection("live") is not None
    assert ids(await store.list_connections()) == {"live"}


# ------------------------------------------------------------------ endpoints


async def test_delete_endpoint_connections_counts_and_spares_other_endpoints(
    store: Store,
) -> None:
    mine = [record(f"a-{i}", endpoint="node-a") for i in range(30)]
    theirs = [record(f"b-{i}", endpoint="node-b") for i in range(5)]
    similar = [record("c-0", endpoint="node-a2")]  # exact match only, not a prefix
    await store.write_connections(mine + theirs + similar, [])
    assert await store.delete_endpoint_connections("node-a") == 30
    assert ids(await store.list_connections()) == {"b-0", "b-1", "b-2", "b-3", "b-4", "c-0"}
    assert await store.delete_endpoint_connections("node-a") == 0
    assert await store.delete_endpoint_connections("nowhere") == 0
    assert len(await store.list_connections()) == 6


async def test_delete_endpoint_connections_includes_expired_rows(store: Store) -> None:
    await store.write_connections(
        [record("old", endpoint="node-a", ttl=int(time.time()) - 100), record("new")], []
    )
    assert await store.delete_endpoint_connections("node-a") == 2
    assert await store.list_connections() == []
    assert await store.delete_endpoint_connections("node-a") == 0


# ------------------------------------------------------------- presence seq


async def test_presence_seq_is_reserved_up_to_a_number(store: Store) -> None:
    assert await store.current_presence_seq() == 0
    assert [await store.reserve_presence_seq(n) for n in (1, 2, 3)] == [1, 2, 3]
    assert await store.current_presence_seq() == 3
    assert await store.current_presence_seq() == 3  # reading does not advance it


async def test_reserving_a_number_again_changes_nothing(store: Store) -> None:
    """What makes a retry harmless: the same call twice answers the same."""
    assert await store.reserve_presence_seq(5) == 5
    assert await store.reserve_presence_seq(5) == 5
    assert await store.current_presence_seq() == 5


async def test_the_presence_seq_never_goes_down(store: Store) -> None:
    assert await store.reserve_presence_seq(7) == 7
    assert await store.reserve_presence_seq(4) == 7  # a number taken and not committed
    values = await asyncio.gather(*(store.reserve_presence_seq(n) for n in range(1, 12)))
    assert max(values) == 11 and all(v >= n for v, n in zip(values, range(1, 12), strict=True))
    assert await store.current_presence_seq() == 11


async def test_presence_seq_is_independent_of_connection_rows(store: Store) -> None:
    await store.reserve_presence_seq(1)
    await store.write_connections([record(f"c{i}") for i in range(3)], [])
    assert await store.delete_endpoint_connections("node-a") == 3
    assert await store.list_connections() == []
    assert await store.current_presence_seq() == 1


# --- the stream reader's records -------------------------------------------------

ARN = "arn:aws:dynamodb:us-east-1:123456789012:table/t/stream/2026-01-01T00:00:00.000"


async def test_the_first_reader_of_a_stream_is_fresh_and_later_ones_are_not(store: Store) -> None:
    first = await store.take_stream_fence(ARN, 1_000)
    assert first.fresh and first.started_at_ms == 1_000
    second = await store.take_stream_fence(ARN, 2_000)
    assert not second.fresh and second.started_at_ms == 1_000
    assert second.fence > first.fence


async def test_a_recreated_stream_starts_fresh_with_a_higher_fence(store: Store) -> None:
    old = await store.take_stream_fence(ARN, 1_000)
    new = await store.take_stream_fence(ARN + "-new", 5_000)
    assert new.fresh and new.started_at_ms == 5_000 and new.fence > old.fence


async def test_checkpoints_round_trip_per_stream(store: Store) -> None:
    fence = (await store.take_stream_fence(ARN, 1)).fence
    await store.save_stream_checkpoint(ARN, ShardCheckpoint("shard-a", "100", False), fence)
    await store.save_stream_checkpoint(ARN, ShardCheckpoint("shard-b", None, True), fence)
    await store.save_stream_checkpoint(ARN + "-old", ShardCheckpoint("shard-c", "7", False), fence)
    assert await store.stream_checkpoints(ARN) == {
        "shard-a": ShardCheckpoint("shard-a", "100", False),
        "shard-b": ShardCheckpoint("shard-b", None, True),
    }
    await store.save_stream_checkpoint(ARN, ShardCheckpoint("shard-a", "250", False), fence)
    assert (await store.stream_checkpoints(ARN))["shard-a"].sequence_number == "250"


async def test_a_stale_reader_cannot_overwrite_a_newer_readers_checkpoint(store: Store) -> None:
    stale = (await store.take_stream_fence(ARN, 1)).fence
    fresh = (await store.take_stream_fence(ARN, 2)).fence
    await store.save_stream_checkpoint(ARN, ShardCheckpoint("shard-a", "300", False), fresh)
    with pytest.raises(Fenced):
        await store.save_stream_checkpoint(ARN, ShardCheckpoint("shard-a", "200", False), stale)
    assert (await store.stream_checkpoints(ARN))["shard-a"].sequence_number == "300"
    # A shard the new reader has not written yet still takes the stale reader's progress.
    await store.save_stream_checkpoint(ARN, ShardCheckpoint("shard-b", "5", False), stale)
    assert (await store.stream_checkpoints(ARN))["shard-b"].sequence_number == "5"
