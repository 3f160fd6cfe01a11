"""Presence rules end to end, seen through a client that applies them like the browser."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import pytest

from protocol.envelope import decode_envelope, encode_envelope
from protocol.messages import PresenceDelta
from server.bus.memory import MemoryBus
from server.bus.topics import PRESENCE
from server.presence.core import MemoryPresenceBackend, PresenceWriter, delta_of, diff
from server.store.memory import MemoryStore
from tests.client import Client
from tests.conftest import TEST_SETTINGS, RunningServer, run_server

DEBOUNCE = TEST_SETTINGS.presence_debounce


def deltas(client: Client) -> list[dict[str, Any]]:
    return [m["payload"] for m in client.of_verb("connections") if m["payload"]["type"] == "delta"]


async def settle(*clients: Client) -> None:
    """Wait out a debounce window and make sure every client has read what was sent."""
    await asyncio.sleep(DEBOUNCE * 3)
    for client in clients:
        await client.barrier()


async def test_own_join_arrives_as_the_next_delta(server: RunningServer) -> None:
    alice = await server.subscribed("alice")
    snapshot_seq = alice.presence.seq
    assert snapshot_seq is not None and "alice" not in alice.presence.visible
    first = await alice.next_message(lambda m: m["payload"].get("type") == "delta")
    assert first["payload"]["seq"] == snapshot_seq + 1
    assert first["payload"]["joins"] == ["alice"]
    assert first["payload"]["totalCount"] == 1


async def test_two_tabs_are_one_user_and_closing_one_is_not_a_leave(
    server: RunningServer,
) -> None:
    watcher = await server.subscribed("watcher")
    tab1 = await server.subscribed("alice")
    tab2 = await server.subscribed("alice")
    await watcher.wait_for(lambda: watcher.presence.visible == {"watcher", "alice"})
    await settle(watcher)
    assert watcher.presence.total_count == 2
    await tab1.close()
    await settle(watcher, tab2)
    assert "alice" in watcher.presence.visible
    assert all("alice" not in d["leaves"] for d in deltas(watcher))
    await tab2.close()
    await watcher.wait_for(lambda: "alice" not in watcher.presence.visible)
    assert watcher.presence.total_count == 1


async def test_invisible_users_count_but_never_show(server: RunningServer) -> None:
    watcher = await server.subscribed("watcher")
    await server.subscribed("ghost", invisible=True)
    await watcher.wait_for(lambda: watcher.presence.server_total == 2)
    late = await server.subscribed("late")
    await settle(watcher, late)
    assert late.presence.server_total == 3
    assert late.presence.visible == {"watcher", "late"}
    for client in (watcher, late):
        assert "ghost" not in client.presence.visible
        assert all("ghost" not in d["joins"] for d in deltas(client))
        for message in client.of_verb("connections"):
            assert "ghost" not in message["payload"].get("visibleUserIds", [])


async def test_a_visible_tab_beside_an_invisible_one_shows_the_user(
    server: RunningServer,
) -> None:
    watcher = await server.subscribed("watcher")
    await server.subscribed("alice", invisible=True)
    await settle(watcher)
    assert "alice" not in watcher.presence.visible
    visible_tab = await server.subscribed("alice")
    await watcher.wait_for(lambda: "alice" in watcher.presence.visible)
    await visible_tab.close()
    await watcher.wait_for(lambda: "alice" not in watcher.presence.visible)
    assert watcher.presence.server_total == 2


@pytest.mark.parametrize("server", [{"presence_debounce_ms": 600}], indirect=True)
async def test_connect_and_disconnect_inside_one_window_produce_nothing(
    server: RunningServer,
) -> None:
    watcher = await server.subscribed("watcher")
    await watcher.wait_for(lambda: watcher.presence.visible == {"watcher"}, within=3)
    seq = watcher.presence.seq
    flapper = await server.subscribed("flapper")
    await flapper.close()
    await asyncio.sleep(1.5)
    await watcher.sync_presence()
    assert watcher.presence.seq == seq
    assert all("flapper" not in d["joins"] + d["leaves"] for d in deltas(watcher))


async def test_joins_and_leaves_in_one_window_coalesce_into_one_delta(
    server: RunningServer,
) -> None:
    watcher = await server.subscribed("watcher")
    await watcher.wait_for(lambda: watcher.presence.visible == {"watcher"})
    before = len(deltas(watcher))
    await asyncio.gather(*(server.subscribed(f"user{i}") for i in range(10)))
    await watcher.wait_for(lambda: len(watcher.presence.visible) == 11)
    new = deltas(watcher)[before:]
    assert len(new) <= 2  # one window, or two if it straddled a flush
    assert sum(len(d["joins"]) for d in new) == 10


async def test_seq_is_gap_free_and_increasing_under_churn(server: RunningServer) -> None:
    observers = [await server.subscribed(f"observer{i}") for i in range(3)]
    rng = random.Random(7)
    live: list[tuple[str, Client]] = []
    for _ in range(60):
        if live and rng.random() < 0.45:
            await live.pop(rng.randrange(len(live)))[1].close()
        else:
            user_id = f"churn{rng.randrange(20)}"
            live.append((user_id, await server.subscribed(user_id)))
        await asyncio.sleep(rng.uniform(0, DEBOUNCE / 2))
    await settle(*observers)
    expected = {f"observer{i}" for i in range(3)} | {user_id for user_id, _ in live}
    for observer in observers:
        assert observer.presence.gaps == 0
        seqs = observer.presence.deltas
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert observer.presence.visible == expected
        assert observer.presence.total_count == len(expected)
    assert observers[0].presence.seq == await server.node.store.current_presence_seq()


async def test_a_lost_delta_makes_the_node_reload_and_the_client_resync(
    server: RunningServer,
) -> None:
    alice = await server.subscribed("alice")
    await alice.wait_for(lambda: alice.presence.visible == {"alice"})
    assert alice.presence.seq is not None
    snapshots = alice.presence.snapshots
    # The bus loses delta seq+1: the node and its clients next hear of seq+2.
    seq = alice.presence.seq
    skipped = PresenceDelta(seq=seq + 2, joins=("ghost",), leaves=(), total_count=2)
    await server.node.bus.publish(PRESENCE, encode_envelope(skipped))
    await alice.wait_for(lambda: alice.presence.gaps == 1)
    await alice.wait_for(lambda: alice.presence.snapshots > snapshots)
    # The node reloaded the committed state, so the resync shows the truth.
    assert alice.presence.seq == seq and alice.presence.visible == {"alice"}
    await server.subscribed("bob")
    await alice.wait_for(lambda: alice.presence.visible == {"alice", "bob"})
    assert alice.presence.gaps == 1


async def test_seq_is_persisted_and_never_goes_back_after_a_restart() -> None:
    store = MemoryStore()
    last_seq = 0
    for _run in range(2):
        async with run_server(TEST_SETTINGS, store=store) as running:
            client = await running.subscribed("alice")
            assert client.presence.seq is not None and client.presence.seq >= last_seq
            await client.wait_for(lambda: "alice" in client.presence.visible)  # noqa: B023
            last_seq = client.presence.seq
            assert await store.current_presence_seq() >= last_seq
    assert last_seq >= 2


def test_delta_of_counts_and_orders() -> None:
    committed = {"a": True, "b": False, "c": True}
    live = {"a": True, "b": True, "d": False}
    changes = diff(committed, live, set(committed) | set(live))
    assert changes == {"b": True, "c": None, "d": False}
    assert delta_of(7, committed, changes) == PresenceDelta(
        seq=7, joins=("b",), leaves=("c",), total_count=3
    )


async def test_the_debounce_window_opens_when_the_change_happened() -> None:
    store = MemoryStore()
    bus = MemoryBus()
    deltas: list[bytes] = []
    await bus.start(lambda _topic, data: deltas.append(data))
    await bus.subscribe([PRESENCE])
    backend = MemoryPresenceBackend(bus, store, "n1")
    await backend.start()
    writer = PresenceWriter(backend, store, debounce=1.0)
    writer.start()
    try:
        await asyncio.wait_for(_until(lambda: writer.leading), 5)
        await asyncio.sleep(1.2)  # the takeover's own look at everyone is over
        await backend.report({"alice": True}, time.time())
        started = time.monotonic()
        # The change happened 0.7 s ago (it took that long to reach the writer).
        writer.hint(["alice"], changed_at=time.time() - 0.7)
        await asyncio.wait_for(_until(lambda: bool(deltas)), 5)
        assert time.monotonic() - started < 0.6
        delta = decode_envelope(deltas[0])
        assert isinstance(delta, PresenceDelta) and delta.joins == ("alice",)
        # A time from a clock far ahead or behind still waits at most one window.
        await backend.report({"bob": True}, time.time())
        started = time.monotonic()
        writer.hint(["bob"], changed_at=time.time() + 3600)
        await asyncio.wait_for(_until(lambda: len(deltas) == 2), 5)
        assert 0.9 < time.monotonic() - started < 1.5
    finally:
        await writer.close()


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in 10 s")


async def test_a_leave_waits_a_whole_window_so_a_quick_return_is_no_flap() -> None:
    """A window that closes between a disconnect and the reconnect (a reload, a
    drained node's client moving) must not commit the leave."""
    store = MemoryStore()
    bus = MemoryBus()
    deltas: list[PresenceDelta] = []

    def on_delta(_topic: str, data: bytes) -> None:
        delta = decode_envelope(data)
        assert isinstance(delta, PresenceDelta)
        deltas.append(delta)

    await bus.start(on_delta)
    await bus.subscribe([PRESENCE])
    backend = MemoryPresenceBackend(bus, store, "n1")
    await backend.start()
    writer = PresenceWriter(backend, store, debounce=0.5)
    writer.start()
    try:
        await asyncio.wait_for(_until(lambda: writer.leading), 5)
        await asyncio.sleep(0.7)
        await backend.report({"alice": True}, time.time())
        writer.hint(["alice"])
        await asyncio.wait_for(_until(lambda: len(deltas) == 1), 5)

        # Offline, in a window that opened 0.45 s earlier and so closes at once.
        await backend.report({"alice": None}, time.time())
        writer.hint(["alice"], changed_at=time.time() - 0.45)
        await asyncio.sleep(0.2)
        assert len(deltas) == 1, "the leave was committed before a whole window passed"
        await backend.report({"alice": True}, time.time())  # back, on any node
        writer.hint(["alice"])
        await asyncio.sleep(1.0)
        assert len(deltas) == 1, [d.leaves for d in deltas]

        # Gone for good: the leave comes one window after the news, not earlier.
        await backend.report({"alice": None}, time.time())
        started = time.monotonic()
        writer.hint(["alice"], changed_at=time.time() - 0.45)
        await asyncio.wait_for(_until(lambda: len(deltas) == 2), 5)
        assert 0.4 < time.monotonic() - started < 1.5
        assert deltas[1].leaves == ("alice",)
    finally:
        await writer.close()
