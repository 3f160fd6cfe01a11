"""Presence rules end to end, seen through a client that applies them like the browser."""

from __future__ import annotations

import asyncio
import random
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
from tests.waiting import eventually

DEBOUNCE = TEST_SETTINGS.presence_debounce


def deltas(client: Client) -> list[dict[str, Any]]:
    return [m["payload"] for m in client.of_verb("connections") if m["payload"]["type"] == "delta"]


async def settle(*clients: Client) -> None:
    """Wait out a debounce window and make sure every client has read what was sent."""
    await asyncio.sleep(DEBOUNCE * 3)
    for client in clients:
        await client.barrier()


async def alice_online(server: RunningServer) -> Client:
    """alice, subscribed and seeing herself online, with nothing more on its way."""
    alice = await server.subscribed("alice")
    await alice.wait_for(lambda: alice.presence.visible == {"alice"})
    await settle(alice)
    return alice


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


@pytest.mark.parametrize("server", [{"presence_debounce_ms": 3000}], indirect=True)
async def test_connect_and_disconnect_inside_one_window_produce_nothing(
    server: RunningServer,
) -> None:
    watcher = await server.subscribed("watcher")
    await watcher.wait_for(lambda: watcher.presence.visible == {"watcher"}, within=15)
    seq = watcher.presence.seq
    assert seq is not None
    flapper = await server.subscribed("flapper")
    await flapper.close()
    # A join after the flap: its delta comes once the flapper has been looked at
    # (in the same window, or in one before it). A long window, so the flap fits.
    await server.subscribed("marker")
    await watcher.wait_for(lambda: "marker" in watcher.presence.visible, within=30)
    assert watcher.presence.seq == seq + 1
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


async def test_a_delta_the_node_missed_reaches_its_clients_as_one_snapshot(
    server: RunningServer,
) -> None:
    alice = await alice_online(server)
    seq = alice.presence.seq
    assert seq is not None
    snapshots = alice.presence.snapshots
    backend, bus = server.node.presence_backend, server.node.bus
    # Committed while the node's subscription hears nothing: it next hears seq+2.
    await bus.unsubscribe([PRESENCE])
    await backend.commit(
        PresenceDelta(seq=seq + 1, joins=("bob",), leaves=(), total_count=2), {"bob": True}
    )
    await bus.subscribe([PRESENCE])
    await backend.commit(
        PresenceDelta(seq=seq + 2, joins=("carol",), leaves=(), total_count=3), {"carol": True}
    )
    await alice.wait_for(lambda: alice.presence.snapshots > snapshots)
    # The node reloaded and sent the committed state itself: its client saw no gap.
    assert alice.presence.seq == seq + 2
    assert alice.presence.visible == {"alice", "bob", "carol"}
    assert alice.presence.gaps == 0
    assert alice.presence.snapshots == snapshots + 1


async def test_a_delta_ahead_of_the_committed_state_is_not_passed_on(
    server: RunningServer,
) -> None:
    alice = await alice_online(server)
    assert alice.presence.seq is not None
    snapshots = alice.presence.snapshots
    metrics = server.node.metrics
    reloads = metrics.value("ap_presence_view_reloads_total")
    current = metrics.value("ap_presence_reloads_current_total")
    # A delta nobody committed reaches the node as if seq+1 had been lost.
    seq = alice.presence.seq
    ghost = PresenceDelta(seq=seq + 2, joins=("ghost",), leaves=(), total_count=2)
    await server.node.bus.publish(PRESENCE, encode_envelope(ghost))
    # The reload finds the committed state the client holds: nothing to send.
    await eventually(
        lambda: metrics.value("ap_presence_reloads_current_total") > current,
        10,
        "a reload that found the view current",
    )
    assert metrics.value("ap_presence_view_reloads_total") == reloads + 1
    await server.subscribed("bob")
    await alice.wait_for(lambda: alice.presence.visible == {"alice", "bob"})
    assert alice.presence.deltas[-1] == seq + 1
    assert alice.presence.gaps == 0 and alice.presence.snapshots == snapshots


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


class ManualClock:
    """The presence writer's wall clock and sleeps, in the test's hands.

    The writer reads ``time.time()`` to open and close its windows and hold
    leaves, and sleeps until a window closes. Here the clock moves only when the
    test moves it, and each sleep is recorded (and lasts a few ms), so a rule
    like "a leave waits a whole window" is checked in the writer's own terms,
    however much CPU the test gets between two steps."""

    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.waits: list[float] = []

    def time(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.waits.append(delay)
        await REAL_SLEEP(0.005)


REAL_SLEEP = asyncio.sleep
LEASE_INTERVAL = 0.0625
"""The writer's lease check interval here: its sleeps are told apart from the windows'."""


async def started_writer(
    debounce: float,
) -> tuple[ManualClock, MemoryPresenceBackend, PresenceWriter, list[PresenceDelta]]:
    """A leading writer on a manual clock over a memory backend, its takeover
    flush done, and the deltas it commits."""
    clock = ManualClock()
    store = MemoryStore()
    bus = MemoryBus()
    committed: list[PresenceDelta] = []

    def on_delta(_topic: str, data: bytes) -> None:
        delta = decode_envelope(data)
        assert isinstance(delta, PresenceDelta)
        committed.append(delta)

    await bus.start(on_delta)
    await bus.subscribe([PRESENCE])
    backend = MemoryPresenceBackend(bus, store, "n1")
    await backend.start()
    writer = PresenceWriter(
        backend,
        store,
        debounce=debounce,
        lease_interval=LEASE_INTERVAL,
        clock=clock.time,
        sleep=clock.sleep,
    )
    writer.start()
    await asyncio.wait_for(_until(lambda: writer.leading), 10)
    await backend.report({"first": True}, clock.now)
    writer.hint(["first"])
    await asyncio.wait_for(_until(lambda: len(committed) == 1), 10)
    return clock, backend, writer, committed


def window_waits(clock: ManualClock, since: int) -> list[float]:
    return [wait for wait in clock.waits[since:] if wait != LEASE_INTERVAL]


async def test_the_debounce_window_opens_when_the_change_happened() -> None:
    clock, backend, writer, committed = await started_writer(1.0)
    try:
        # The change happened 0.7 s ago (it took that long to reach the writer):
        # its window has 0.3 s left.
        await backend.report({"alice": True}, clock.now)
        waits = len(clock.waits)
        writer.hint(["alice"], changed_at=clock.now - 0.7)
        await asyncio.wait_for(_until(lambda: len(committed) == 2), 10)
        assert committed[1].joins == ("alice",)
        assert window_waits(clock, waits)[0] == pytest.approx(0.3)

        # A time from a clock far ahead or behind still waits one window at most.
        for user, changed_at in (("bob", clock.now + 3600), ("carol", clock.now - 3600)):
            await backend.report({user: True}, clock.now)
            waits, count = len(clock.waits), len(committed)
            writer.hint([user], changed_at=changed_at)
            await asyncio.wait_for(_until(lambda: len(committed) > count), 10)  # noqa: B023
            assert committed[-1].joins == (user,)
            assert 0 <= window_waits(clock, waits)[0] <= 1.0
    finally:
        await writer.close()


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await REAL_SLEEP(0.01)


async def test_a_leave_waits_a_whole_window_so_a_quick_return_is_no_flap() -> None:
    """A window that closes between a disconnect and the reconnect (a reload, a
    drained node's client moving) must not commit the leave."""
    clock, backend, writer, committed = await started_writer(0.5)

    async def marked(user: str) -> None:
        """A join, committed after everything hinted before it was looked at."""
        count = len(committed)
        await backend.report({user: True}, clock.now)
        writer.hint([user])
        await asyncio.wait_for(_until(lambda: any(user in d.joins for d in committed)), 10)
        assert len(committed) > count

    def left(user: str) -> bool:
        return any(user in d.leaves for d in committed)

    try:
        await marked("alice")
        # Offline, in a window that opened 0.45 s earlier and so closes at once;
        # the clock stands still, so a whole window has not passed since the news.
        await backend.report({"alice": None}, clock.now)
        writer.hint(["alice"], changed_at=clock.now - 0.45)
        await marked("carol")
        assert not left("alice"), "the leave was committed before a whole window passed"
        await backend.report({"alice": True}, clock.now)  # back, on any node
        writer.hint(["alice"])
        clock.now += 10
        await marked("dave")
        assert not left("alice"), [d.leaves for d in committed]

        # Gone for good: held until a whole window has passed since the news...
        await backend.report({"alice": None}, clock.now)
        writer.hint(["alice"], changed_at=clock.now - 0.45)
        await marked("erin")
        clock.now += 0.4
        await marked("frank")
        assert not left("alice")
        # ...then committed.
        clock.now += 0.1
        await asyncio.wait_for(_until(lambda: left("alice")), 10)
    finally:
        await writer.close()


async def test_a_reconnect_that_lost_nothing_sends_no_snapshot(server: RunningServer) -> None:
    alice = await alice_online(server)
    snapshots = alice.presence.snapshots
    metrics = server.node.metrics
    reloads = metrics.value("ap_presence_view_reloads_total")
    current = metrics.value("ap_presence_reloads_current_total")
    server.node.presence.resync()  # what a bus reconnect runs
    await eventually(
        lambda: metrics.value("ap_presence_reloads_current_total") > current,
        10,
        "a reload that found the view current",
    )
    assert metrics.value("ap_presence_view_reloads_total") == reloads + 1
    # A snapshot would have left in the reload's turn, before this answer.
    await alice.barrier()
    assert alice.presence.snapshots == snapshots
    assert alice.presence.visible == {"alice"} and alice.presence.gaps == 0
