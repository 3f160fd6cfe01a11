"""Write-behind of connection rows: coalescing, batching, and retries that lose nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from server.runtime.connection_rows import (
    ROWS_PER_WRITE,
    ConnectionRegistry,
    Delete,
    Put,
    Ttl,
    Watch,
    merge,
)
from server.store.base import ConnectionRecord
from server.store.memory import MemoryStore
from tests.conftest import TEST_SETTINGS, run_server


def record(cid: str, **overrides: object) -> ConnectionRecord:
    fields: dict[str, object] = {
        "connection_id": cid,
        "user_id": "u",
        "invisible": False,
        "endpoint": "n1",
        "wants_presence": True,
        "watch_version": None,
        "watching_games": frozenset(),
        "ttl": 2_000_000_000,
    }
    fields.update(overrides)
    return ConnectionRecord(**fields)  # type: ignore[arg-type]


def test_merge_keeps_the_effect_of_both_operations() -> None:
    put = Put(record("c"))
    merged = merge(put, Watch(frozenset({"a#1"}), 1, 2_000_000_100))
    assert merged == Put(
        record("c", watching_games=frozenset({"a#1"}), watch_version=1, ttl=2_000_000_100)
    )
    assert merge(merged, Ttl(2_000_000_200)) == Put(
        record("c", watching_games=frozenset({"a#1"}), watch_version=1, ttl=2_000_000_200)
    )
    assert merge(Watch(frozenset(), 1, 5), Ttl(6)) == Watch(frozenset(), 1, 6)
    assert merge(put, Delete()) == Delete()
    assert merge(Delete(), Watch(frozenset(), 1, 5)) == Delete()
    assert merge(Delete(), Ttl(5)) == Delete()


class FlakyStore(MemoryStore):
    """The real memory store behind a switch that makes writes fail, like an outage."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.batches: list[int] = []

    async def write_connections(
        self, puts: Sequence[ConnectionRecord], deletes: Sequence[str]
    ) -> None:
        if self.down:
            raise ConnectionError("store unreachable")
        self.batches.append(len(puts) + len(deletes))
        await super().write_connections(puts, deletes)

    async def update_watch(
        self, connection_id: str, games: frozenset[str], watch_version: int, ttl: int
    ) -> None:
        if self.down:
            raise ConnectionError("store unreachable")
        await super().update_watch(connection_id, games, watch_version, ttl)


async def test_writes_during_an_outage_land_once_it_ends() -> None:
    store = FlakyStore()
    registry = ConnectionRegistry(store)
    registry.start()
    try:
        for i in range(50):
            registry.put(record(f"c{i}"))
        await asyncio.sleep(0.3)  # several failed attempts
        registry.watch("c1", frozenset({"chess#g1"}), 1, 2_000_000_500)
        registry.delete("c2")
        assert await store.list_connections() == []
        store.down = False
        await asyncio.wait_for(registry.drained(), timeout=10)
        rows = {r.connection_id: r for r in await store.list_connections()}
        assert len(rows) == 49 and "c2" not in rows
        assert rows["c1"].watching_games == frozenset({"chess#g1"})
        assert rows["c1"].ttl == 2_000_000_500
    finally:
        await registry.close()


async def test_a_connect_burst_is_written_in_few_batches() -> None:
    store = FlakyStore()
    store.down = False
    registry = ConnectionRegistry(store)
    registry.start()
    try:
        for i in range(1000):
            registry.put(record(f"c{i}"))
        await asyncio.wait_for(registry.drained(), timeout=10)
        # one coalesced batch, sent as full BatchWriteItem chunks, each behind the pacer
        assert store.batches == [ROWS_PER_WRITE] * (1000 // ROWS_PER_WRITE)
    finally:
        await registry.close()


class WatchCountingStore(FlakyStore):
    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.watch_writes: list[frozenset[str]] = []

    async def update_watch(
        self, connection_id: str, games: frozenset[str], watch_version: int, ttl: int
    ) -> None:
        self.watch_writes.append(games)
        await super().update_watch(connection_id, games, watch_version, ttl)


async def test_a_repeated_watch_games_writes_no_row_and_delivery_goes_on() -> None:
    # The browser sends the same watchGames after subscribing, 250 ms and 1 s later.
    store = WatchCountingStore()
    writes = store.watch_writes
    async with run_server(TEST_SETTINGS, store) as server:
        client = await server.subscribed("alice", games=[("chess", "g1")], since={})
        await server.node.registry.drained()
        rows = len(store.batches)
        for _ in range(3):
            await client.watch([("chess", "g1")])
        await client.barrier()
        await server.node.registry.drained()
        assert writes == [] and len(store.batches) == rows
        status, _ = await server.publish(
            {"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": 1}}
        )
        assert status == 202
        await client.wait_for(lambda: client.offsets("game:chess#g1") == [1])
        await client.watch([("chess", "g2")])
        await client.barrier()
        await server.node.registry.drained()
        assert writes == [frozenset({"chess#g2"})]
