"""A node's presence view against the committed seq: a delta that never arrives is
found by the periodic check, and one merely in flight, or heard and waiting behind
a slow reload, is not.

Pub/sub may lose a delta without any connection noticing (seen after a whole
Redis Cluster restart: one node's subscription went silent while its connection
stayed up). A gap shows only when a later
delta arrives, so without this check the last delta before a quiet spell stayed
lost: observers kept a stale list for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import AsyncExitStack

import pytest

from protocol.messages import PresenceDelta
from server.presence.core import Changes, CommittedPresence, Member, UserStates
from server.presence.node_presence import NodePresence
from server.runtime.metrics import Registry
from server.session import Session
from server.store.memory import MemoryStore
from tests.conftest import TEST_SETTINGS
from tests.waiting import eventually

CHECK = 0.02
WITHIN = 10.0


class CommittedElsewhere:
    """A backend whose commits happen on another node: the test sets what is committed."""

    def __init__(self) -> None:
        self.state = CommittedPresence(seq=3, users={"alice": True})
        self.reloads_open = asyncio.Event()  # cleared: a reload waits until it is set
        self.reloads_open.set()
        self.reloads_fail = False
        self.seq_reads = 0  # the view check's reads

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def report(self, changes: Changes, changed_at: float) -> None:
        return None

    async def online(self, user_ids: Collection[str] | None) -> UserStates:
        return {}

    async def committed(self) -> CommittedPresence:
        await self.reloads_open.wait()
        if self.reloads_fail:
            raise ConnectionError("Redis away")
        return CommittedPresence(self.state.seq, dict(self.state.users))

    async def committed_seq(self) -> int | None:
        self.seq_reads += 1
        return self.state.seq

    async def commit(self, delta: PresenceDelta, changes: Changes) -> bool:
        return False

    async def lead(self) -> bool:
        return False  # another node writes

    async def members(self) -> list[Member]:
        return []


@pytest.fixture
async def running() -> AsyncIterator[tuple[NodePresence, CommittedElsewhere, Registry, list[str]]]:
    backend = CommittedElsewhere()
    metrics = Registry()
    rechecks: list[str] = []
    sessions: set[Session] = set()
    presence = NodePresence(
        TEST_SETTINGS,
        backend,
        MemoryStore(),
        sessions,
        sessions,
        lambda _user: None,
        metrics,
        check_interval=CHECK,
    )
    presence.on_lost_delta(lambda: rechecks.append("recheck"))
    async with AsyncExitStack() as stack:
        await presence.start(stack)
        yield presence, backend, metrics, rechecks


def lost_deltas(metrics: Registry) -> float:
    return metrics.value("ap_presence_lost_deltas_total")


def at_seq(presence: NodePresence, seq: int) -> Callable[[], bool]:
    return lambda: presence.view.seq == seq


async def test_a_delta_that_never_arrives_reloads_the_view_and_asks_for_a_recheck(
    running: tuple[NodePresence, CommittedElsewhere, Registry, list[str]],
) -> None:
    presence, backend, metrics, rechecks = running
    assert presence.view.seq == 3
    # Committed elsewhere; its delta is lost on the way to this node.
    backend.state = CommittedPresence(seq=4, users={"alice": True, "bob": True})
    await eventually(at_seq(presence, 4), WITHIN, "the view reloaded")
    assert presence.view.visible == {"alice", "bob"}
    assert lost_deltas(metrics) == 1
    assert rechecks == ["recheck"]


async def test_a_delta_in_flight_is_waited_for_not_reported_lost(
    running: tuple[NodePresence, CommittedElsewhere, Registry, list[str]],
) -> None:
    presence, backend, metrics, rechecks = running
    for seq in range(4, 9):
        backend.state = CommittedPresence(seq=seq, users={"alice": True, f"u{seq}": True})
        # Its delta comes before the check after next, however the loop is scheduled.
        presence.delta(PresenceDelta(seq=seq, joins=(f"u{seq}",), leaves=(), total_count=2))
        await eventually(at_seq(presence, seq), WITHIN, f"delta {seq} applied")
    # Several checks pass with the view level with the committed seq.
    await asyncio.sleep(CHECK * 5)
    assert presence.view.seq == 8
    assert lost_deltas(metrics) == 0
    assert rechecks == []


async def checks_pass(backend: CommittedElsewhere, count: int) -> None:
    """Wait until the view check has read the committed seq ``count`` more times."""
    target = backend.seq_reads + count
    await eventually(lambda: backend.seq_reads >= target, WITHIN, f"{count} view checks")


async def test_a_delta_heard_behind_a_slow_reload_is_not_reported_lost(
    running: tuple[NodePresence, CommittedElsewhere, Registry, list[str]],
) -> None:
    presence, backend, metrics, rechecks = running
    backend.reloads_open.clear()
    # Seq 4 never came: the gap at 5 sends the delta loop to a reload, which hangs.
    backend.state = CommittedPresence(seq=5, users={"alice": True, "bob": True})
    presence.delta(PresenceDelta(seq=5, joins=("bob",), leaves=(), total_count=2))
    # Seq 6 is heard while the loop waits: it is queued, not lost.
    backend.state = CommittedPresence(seq=6, users={"alice": True, "bob": True, "carol": True})
    presence.delta(PresenceDelta(seq=6, joins=("carol",), leaves=(), total_count=3))
    await checks_pass(backend, 4)
    assert presence.view.seq == 3  # the view itself is still behind
    assert lost_deltas(metrics) == 0
    assert rechecks == []
    backend.reloads_open.set()
    await eventually(at_seq(presence, 6), WITHIN, "the reload and the queued delta")
    assert presence.view.visible == {"alice", "bob", "carol"}
    await checks_pass(backend, 3)
    assert lost_deltas(metrics) == 0
    assert rechecks == []


async def test_a_delta_dropped_after_a_failed_reload_is_still_found(
    running: tuple[NodePresence, CommittedElsewhere, Registry, list[str]],
) -> None:
    presence, backend, metrics, rechecks = running
    backend.reloads_fail = True
    backend.state = CommittedPresence(seq=5, users={"alice": True, "bob": True})
    # Heard, but after the gap's reload fails it cannot be applied: the view stays at 3.
    presence.delta(PresenceDelta(seq=5, joins=("bob",), leaves=(), total_count=2))
    await eventually(lambda: lost_deltas(metrics) >= 1, WITHIN, "the check found the view behind")
    assert presence.view.seq == 3
    assert rechecks and set(rechecks) == {"recheck"}
    backend.reloads_fail = False
    await eventually(at_seq(presence, 5), WITHIN, "the view reloaded")
    assert presence.view.visible == {"alice", "bob"}


def reloads(metrics: Registry) -> tuple[float, float]:
    """(view reloads, reloads that found the view current and sent no snapshot)."""
    return (
        metrics.value("ap_presence_view_reloads_total"),
        metrics.value("ap_presence_reloads_current_total"),
    )


async def test_the_resync_after_a_lost_delta_sends_its_watchers_no_second_snapshot(
    running: tuple[NodePresence, CommittedElsewhere, Registry, list[str]],
) -> None:
    presence, backend, metrics, rechecks = running
    # As on Redis: the recheck reconnects the bus, whose callbacks resync presence.
    presence.on_lost_delta(presence.resync)
    before, current = reloads(metrics)
    backend.state = CommittedPresence(seq=4, users={"alice": True, "bob": True})
    # The check's reload took seq 4 and snapshotted it; the resync's found it current.
    expected = (before + 2, current + 1)
    await eventually(lambda: reloads(metrics) == expected, WITHIN, "both reloads")
    assert presence.view.seq == 4 and presence.view.visible == {"alice", "bob"}
    assert rechecks == ["recheck"]


async def test_a_resync_that_finds_a_change_sends_the_snapshot(
    running: tuple[NodePresence, CommittedElsewhere, Registry, list[str]],
) -> None:
    presence, backend, metrics, _rechecks = running
    before, current = reloads(metrics)
    presence.resync()
    # Nothing changed since the start.
    expected = (before + 1, current + 1)
    await eventually(lambda: reloads(metrics) == expected, WITHIN, "the first reload")
    # A change whose delta this node missed while its bus was away.
    backend.state = CommittedPresence(seq=4, users={"alice": True, "bob": False})
    presence.resync()
    await eventually(at_seq(presence, 4), WITHIN, "the second reload")
    assert reloads(metrics) == (before + 2, current + 1)
    assert presence.view.total == 2
    assert presence.view.visible == {"alice"}
