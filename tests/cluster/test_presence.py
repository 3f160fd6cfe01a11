"""Presence across nodes: one gap-free stream, users counted once however many nodes."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.client import Client
from tests.cluster.conftest import BOTH_REDIS
from tests.cluster.harness import DEBOUNCE_MS, SLACK, Cluster, wait_visible
from tests.waiting import eventually

pytestmark = BOTH_REDIS


def deltas(client: Client) -> list[dict[str, Any]]:
    return [m["payload"] for m in client.of_verb("connections") if m["payload"]["type"] == "delta"]


def assert_clean_stream(client: Client) -> None:
    """Every delta was applied in order, with no gap and no resync needed."""
    state = client.presence
    assert state.gaps == 0
    assert state.deltas == list(range(state.deltas[0], state.deltas[0] + len(state.deltas)))


async def settle() -> None:
    await asyncio.sleep(3 * DEBOUNCE_MS / 1000)


async def test_one_stream_and_one_state_on_every_node(cluster: Cluster) -> None:
    observers = [await cluster.client(name, f"obs-{name}") for name in ("n1", "n2", "n3")]
    users: list[Client] = []
    for i in range(9):
        name = ("n1", "n2", "n3")[i % 3]
        users.append(await cluster.client(name, f"user{i}", invisible=(i == 4)))
    expected = {f"obs-{n}" for n in ("n1", "n2", "n3")} | {f"user{i}" for i in range(9) if i != 4}
    for observer in observers:
        await wait_visible(observer, expected, 5 + SLACK, "joins")
    await users[0].close()
    await users[5].close()
    expected -= {"user0", "user5"}
    for observer in observers:
        await wait_visible(observer, expected, 5 + SLACK, "leaves")
        await observer.sync_presence()
    seqs = {observer.presence.seq for observer in observers}
    assert len(seqs) == 1, "every node shows the same seq"
    for observer in observers:
        assert_clean_stream(observer)
        assert observer.presence.total_count == len(expected) + 1  # the invisible user counts
        assert "user4" not in observer.presence.visible
    # A snapshot taken on any node shows the same state at the same seq (the new
    # tabs belong to a user already online, so they change nothing).
    fresh = [await cluster.client(name, "obs-n1") for name in ("n1", "n2", "n3")]
    snapshots = [
        next(m["payload"] for m in c.messages if m["payload"].get("type") == "snapshot")
        for c in fresh
    ]
    assert len({s["seq"] for s in snapshots}) == 1
    assert len({tuple(s["visibleUserIds"]) for s in snapshots}) == 1
    assert snapshots[0]["seq"] == seqs.pop()
    assert await cluster.presence_seq() >= snapshots[0]["seq"]


async def test_the_same_user_on_two_nodes_closing_one_is_not_a_leave(cluster: Cluster) -> None:
    observer = await cluster.client("n3", "observer")
    tab1 = await cluster.client("n1", "alice")
    tab2 = await cluster.client("n2", "alice")
    await eventually(lambda: "alice" in observer.presence.visible, 5 + SLACK, "alice's join")
    await settle()
    await tab1.close()
    # Wait out the debounce, then make a later change and wait for it: had
    # alice's leave been committed, it would have reached the observer first.
    await settle()
    await cluster.client("n1", "bob")
    await eventually(lambda: "bob" in observer.presence.visible, 5 + SLACK, "bob's join")
    assert "alice" in observer.presence.visible
    assert all("alice" not in d["leaves"] for d in deltas(observer))
    assert sum("alice" in d["joins"] for d in deltas(observer)) == 1
    await tab2.close()
    await eventually(lambda: "alice" not in observer.presence.visible, 5 + SLACK, "alice's leave")
    assert_clean_stream(observer)
    assert observer.presence.total_count == 2


async def test_a_quick_move_between_nodes_is_not_a_flap(cluster: Cluster) -> None:
    observer = await cluster.client("n3", "observer")
    first = await cluster.client("n1", "alice")
    await eventually(lambda: "alice" in observer.presence.visible, 5 + SLACK, "alice's join")
    await settle()
    # A reload lands on another node: close on n1, open on n2 within the debounce.
    await first.close()
    await cluster.client("n2", "alice")
    await settle()
    await cluster.client("n1", "bob")
    await eventually(lambda: "bob" in observer.presence.visible, 5 + SLACK, "bob's join")
    assert all("alice" not in d["leaves"] for d in deltas(observer))
    assert_clean_stream(observer)
