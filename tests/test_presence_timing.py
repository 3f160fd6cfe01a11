"""When presence changes reach the cluster, on a virtual clock: the writer's windows
are counted, never timed, so the verdicts do not depend on the machine's load.

The rules (debounce D): a join is committed within D of its news; a leave is held
until a whole window has passed since its news (the no-flap rule), and committed
within 2 x D of it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random

from protocol.envelope import decode_envelope
from protocol.messages import PresenceDelta
from server.bus.memory import MemoryBus
from server.bus.topics import PRESENCE
from server.presence.core import AUDIT_INTERVAL, MemoryPresenceBackend, PresenceWriter
from server.runtime.metrics import Registry
from server.store.memory import MemoryStore

D = 1.0
SETTLE_TURNS = 50
"""Loop turns that let every ready step run (memory store and bus: no I/O waits)."""


class VirtualClock:
    """Epoch seconds that move only when the test says; sleepers wake in order."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._order), waiter))
        await waiter

    async def advance_to(self, until: float) -> None:
        await settle()
        while self._sleepers and self._sleepers[0][0] <= until:
            deadline, _, waiter = heapq.heappop(self._sleepers)
            self.now = max(self.now, deadline)
            if not waiter.done():
                waiter.set_result(None)
            await settle()
        self.now = max(self.now, until)
        await settle()


async def settle() -> None:
    for _ in range(SETTLE_TURNS):
        await asyncio.sleep(0)


class Harness:
    def __init__(self, lease_interval: float = 1.0) -> None:
        self.clock = VirtualClock()
        self.committed: list[tuple[float, PresenceDelta]] = []
        self.metrics = Registry()
        self.lease_interval = lease_interval

    async def start(self) -> None:
        store = MemoryStore()
        bus = MemoryBus()

        def on_delta(_topic: str, data: bytes) -> None:
            delta = decode_envelope(data)
            assert isinstance(delta, PresenceDelta)
            self.committed.append((self.clock.now, delta))

        await bus.start(on_delta)
        await bus.subscribe([PRESENCE])
        self.backend = MemoryPresenceBackend(bus, store, "n1")
        await self.backend.start()
        self.writer = PresenceWriter(
            self.backend,
            store,
            D,
            lease_interval=self.lease_interval,
            metrics=self.metrics,
            clock=self.clock.time,
            sleep=self.clock.sleep,
        )
        self.writer.start()
        for _ in range(100):
            if self.writer.leading:
                break
            await asyncio.sleep(0.01)
        assert self.writer.leading
        await self.clock.advance_to(self.clock.now + 2 * D)  # the takeover's full look
        self.committed.clear()

    async def change(self, user: str, online: bool) -> float:
        """A user's news reaches the writer now; returns when."""
        await self.backend.report({user: True if online else None}, self.clock.now)
        self.writer.hint([user], self.clock.now)
        return self.clock.now

    def when(self, user: str, kind: str) -> list[float]:
        return [
            at
            for at, delta in self.committed
            if user in (delta.joins if kind == "join" else delta.leaves)
        ]


async def test_joins_within_one_window_and_leaves_within_two_under_churn() -> None:
    harness = Harness()
    await harness.start()
    try:
        rng = random.Random(21)
        origin = harness.clock.now
        events: list[tuple[float, str, bool]] = []
        for index in range(120):
            join_at = origin + rng.uniform(0, 6 * D)
            events.append((join_at, f"u{index}", True))
            events.append((join_at + rng.uniform(1.5 * D, 3 * D), f"u{index}", False))
        events.sort()
        heard: dict[tuple[str, str], float] = {}
        for at, user, online in events:
            await harness.clock.advance_to(at)
            heard[(user, "join" if online else "leave")] = await harness.change(user, online)
        await harness.clock.advance_to(harness.clock.now + 3 * D)
        for (user, kind), at in heard.items():
            commits = harness.when(user, kind)
            assert len(commits) == 1, (user, kind, commits)
            latency = commits[0] - at
            if kind == "join":
                assert latency <= D + 1e-6, (user, latency)
            else:
                assert D - 1e-6 <= latency <= 2 * D + 1e-6, (user, latency)
    finally:
        await harness.writer.close()


async def test_a_return_within_a_window_of_the_leave_is_no_flap() -> None:
    harness = Harness()
    await harness.start()
    try:
        await harness.change("alice", True)
        await harness.clock.advance_to(harness.clock.now + 1.5 * D)
        assert harness.when("alice", "join")
        # Gone just before a window closes, back 0.9 D later: never a leave.
        await harness.change("bob", True)  # opens a window now
        await harness.clock.advance_to(harness.clock.now + 0.95 * D)
        await harness.change("alice", False)
        await harness.clock.advance_to(harness.clock.now + 0.9 * D)
        await harness.change("alice", True)
        await harness.clock.advance_to(harness.clock.now + 4 * D)
        assert harness.when("alice", "leave") == []
        assert harness.when("bob", "join")
    finally:
        await harness.writer.close()


async def test_a_change_whose_hint_was_lost_is_found_by_the_audit() -> None:
    harness = Harness(lease_interval=0.01)
    await harness.start()
    try:
        # carol's node recorded her, but the hint never reached the writer.
        await harness.backend.report({"carol": True}, harness.clock.now)
        await harness.change("dave", True)
        await harness.clock.advance_to(harness.clock.now + 3 * D)
        assert harness.when("dave", "join") and harness.when("carol", "join") == []
        await harness.clock.advance_to(harness.clock.now + AUDIT_INTERVAL)
        for _ in range(500):  # the lease loop ticks in real time: let it see the audit due
            await asyncio.sleep(0.01)
            await harness.clock.advance_to(harness.clock.now + 0.1 * D)
            if harness.when("carol", "join"):
                break
        assert len(harness.when("carol", "join")) == 1
        assert harness.metrics.value("ap_presence_audit_repairs_total") == 1
        # An audit that finds everything as committed repairs nothing and commits nothing.
        committed = len(harness.committed)
        await harness.clock.advance_to(harness.clock.now + AUDIT_INTERVAL + 2 * D)
        await asyncio.sleep(0.1)
        await harness.clock.advance_to(harness.clock.now + 2 * D)
        assert len(harness.committed) == committed
        assert harness.metrics.value("ap_presence_audit_repairs_total") == 1
    finally:
        await harness.writer.close()
