"""Presence: who is online, as one gap-free stream of deltas for the whole cluster.

Four parts, each with one job:

- :class:`LocalPresence` counts this node's connections per user and reports a
  user only when their state on this node changes (first tab, last tab,
  visibility). Two tabs are one user.
- :class:`PresenceBackend` holds every node's reports and the committed state
  (memory for the embedded default, Redis for a cluster).
- :class:`PresenceWriter` runs on the single elected writer. It debounces
  hints, diffs the live state against the committed one, takes the next
  ``seq`` from the store's ``wsMeta/presenceSeq`` counter, and commits the
  delta. The commit publishes the delta on the bus.
- :class:`PresenceView` is each node's replica of the committed state, fed
  by those deltas in order. Snapshots come from it, so a snapshot carries
  exactly the seq of the state it shows.

State per user: ``True`` online and visible, ``False`` online but invisible
(counted in ``totalCount`` only), absent when offline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from protocol.codec import Frame
from protocol.envelope import PresenceHint, encode_envelope
from protocol.messages import PresenceDelta, PresenceSnapshot
from server.bus.base import Bus
from server.bus.topics import PRESENCE, PRESENCE_HINTS
from server.runtime.backoff import Backoff
from server.runtime.metrics import Registry
from server.runtime.tasks import cancel_all_and_wait
from server.store.base import Store

log = logging.getLogger(__name__)

UserStates = dict[str, bool]
Changes = dict[str, bool | None]
"""New state per user; None means offline."""

FLUSH_RETRY = Backoff(first=1.0, cap=1.0, jitter=0.8)
"""A failed flush is tried again 0.2 to 1 s later: soon, but not in step with other nodes."""
AUDIT_INTERVAL = 30.0
"""How often the writer looks at every user without being hinted. Hints travel
by pub/sub, which delivers at most once (a subscriber reconnecting to a restarted
Redis misses what was published meanwhile): a lost hint costs at most this long."""


@dataclass
class CommittedPresence:
    seq: int
    users: UserStates = field(default_factory=dict)


@dataclass(frozen=True)
class Member:
    """One node as the cluster sees it."""

    node_id: str
    heartbeat_age_ms: int
    users: int
    writer: bool


class PresenceBackend(Protocol):
    """Where nodes report their users and the writer commits deltas."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def report(self, changes: Changes, changed_at: float) -> None:
        """Record this node's user changes, then hint the writer about them.

        ``changed_at`` (epoch seconds) is when the first of them happened.
        """

    async def online(self, user_ids: Collection[str] | None) -> UserStates:
        """Cluster-wide state of these users (all online users when None)."""

    async def committed(self) -> CommittedPresence:
        """The committed state and its seq, read atomically."""

    async def committed_seq(self) -> int | None:
        """The committed seq alone (None while the backend holds no state yet)."""

    async def commit(self, delta: PresenceDelta, changes: Changes) -> bool:
        """Apply ``changes`` as ``delta`` and publish it, if still the writer."""

    async def lead(self) -> bool:
        """Acquire or renew the writer role; True while this node holds it."""

    async def members(self) -> list[Member]:
        """Every node of the cluster as last heard of, for operators."""


class MemoryPresenceBackend:
    """One process is the whole cluster: its node is always the writer."""

    def __init__(self, bus: Bus, store: Store, node_id: str) -> None:
        self._bus = bus
        self._store = store
        self._node_id = node_id
        self._live: UserStates = {}
        self._committed = CommittedPresence(seq=0)

    async def start(self) -> None:
        # Users do not outlive the process, but the seq does: clients that
        # reconnect must never see it go backwards.
        self._committed = CommittedPresence(seq=await self._store.current_presence_seq())

    async def close(self) -> None:
        return None

    async def report(self, changes: Changes, changed_at: float) -> None:
        apply_changes(self._live, changes)
        hint = PresenceHint(node_id=self._node_id, user_ids=tuple(changes), changed_at=changed_at)
        await self._bus.publish(PRESENCE_HINTS, encode_envelope(hint))

    async def online(self, user_ids: Collection[str] | None) -> UserStates:
        if user_ids is None:
            return dict(self._live)
        return {u: self._live[u] for u in user_ids if u in self._live}

    async def committed(self) -> CommittedPresence:
        return CommittedPresence(self._committed.seq, dict(self._committed.users))

    async def committed_seq(self) -> int | None:
        return self._committed.seq

    async def commit(self, delta: PresenceDelta, changes: Changes) -> bool:
        apply_changes(self._committed.users, changes)
        self._committed.seq = delta.seq
        await self._bus.publish(PRESENCE, encode_envelope(delta))
        return True

    async def lead(self) -> bool:
        return True

    async def members(self) -> list[Member]:
        return [Member(self._node_id, 0, len(self._live), writer=True)]


def apply_changes(users: UserStates, changes: Changes) -> None:
    for user_id, state in changes.items():
        if state is None:
            users.pop(user_id, None)
        else:
            users[user_id] = state


def diff(committed: UserStates, live: UserStates, user_ids: Iterable[str]) -> Changes:
    """The changes that turn ``committed`` into ``live`` for these users."""
    changes: Changes = {}
    for user_id in user_ids:
        new = live.get(user_id)
        if committed.get(user_id) != new:
            changes[user_id] = new
    return changes


def delta_of(seq: int, committed: UserStates, changes: Changes) -> PresenceDelta:
    """The delta that applying ``changes`` to ``committed`` shows to clients."""
    joins = sorted(u for u, new in changes.items() if new is True)
    leaves = sorted(u for u, new in changes.items() if new is not True and committed.get(u))
    total = len(committed)
    for user_id, new in changes.items():
        total += (new is not None) - (user_id in committed)
    return PresenceDelta(seq=seq, joins=tuple(joins), leaves=tuple(leaves), total_count=total)


class LocalPresence:
    """This node's connections per user, reported to the backend on transitions."""

    def __init__(self) -> None:
        # user -> [visible connections, invisible connections]
        self._counts: dict[str, list[int]] = {}
        self.pending: Changes = {}

    def _state(self, user_id: str) -> bool | None:
        counts = self._counts.get(user_id)
        if counts is None:
            return None
        return counts[0] > 0

    def add(self, user_id: str, invisible: bool) -> None:
        before = self._state(user_id)
        counts = self._counts.setdefault(user_id, [0, 0])
        counts[1 if invisible else 0] += 1
        self._changed(user_id, before)

    def remove(self, user_id: str, invisible: bool) -> None:
        before = self._state(user_id)
        counts = self._counts[user_id]
        counts[1 if invisible else 0] -= 1
        if counts == [0, 0]:
            del self._counts[user_id]
        self._changed(user_id, before)

    def _changed(self, user_id: str, before: bool | None) -> None:
        after = self._state(user_id)
        if after != before:
            self.pending[user_id] = after

    def take_pending(self) -> Changes:
        pending, self.pending = self.pending, {}
        return pending

    def states(self) -> UserStates:
        """Every user of this node and their state, to re-report after a backend loss."""
        return {user_id: counts[0] > 0 for user_id, counts in self._counts.items()}

    @property
    def user_count(self) -> int:
        return len(self._counts)


class PresenceView:
    """This node's replica of the committed state."""

    def __init__(self, seq: int = 0) -> None:
        self.seq = seq
        self.visible: set[str] = set()
        self.total = 0
        self._snapshot: Frame | None = None

    def reset(self, committed: CommittedPresence) -> bool:
        """Take ``committed`` as the view; False when it is the state the view
        already had (same seq, same users), so nothing changed for its watchers."""
        visible = {user_id for user_id, visible in committed.users.items() if visible}
        total = len(committed.users)
        if committed.seq == self.seq and total == self.total and visible == self.visible:
            return False
        self.seq = committed.seq
        self.visible = visible
        self.total = total
        self._snapshot = None
        return True

    def apply(self, delta: PresenceDelta) -> None:
        """Apply the next delta; the caller checks ``delta.seq == self.seq + 1``."""
        self.visible.difference_update(delta.leaves)
        self.visible.update(delta.joins)
        self.total = delta.total_count
        self.seq = delta.seq
        self._snapshot = None

    def snapshot_frame(self) -> Frame:
        """The snapshot of the current state, encoded once per seq."""
        if self._snapshot is None:
            self._snapshot = Frame(
                PresenceSnapshot(
                    seq=self.seq,
                    total_count=self.total,
                    visible_user_ids=tuple(sorted(self.visible)),
                )
            )
        return self._snapshot


class PresenceWriter:
    """Turns hints into committed deltas, on whichever node holds the writer role."""

    def __init__(
        self,
        backend: PresenceBackend,
        store: Store,
        debounce: float,
        *,
        lease_interval: float = 1.0,
        audit_interval: float = AUDIT_INTERVAL,
        metrics: Registry | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """``clock`` (epoch seconds) and ``sleep`` time the debounce windows; tests
        pass a virtual clock to count windows rather than measure them."""
        registry = metrics or Registry()
        self._deltas_committed = registry.counter(
            "ap_presence_deltas_total", "Presence deltas committed"
        )
        self._failures = registry.counter(
            "ap_presence_writer_failures_total", "Presence flushes that failed and were retried"
        )
        self._unhinted = registry.counter(
            "ap_presence_audit_repairs_total",
            "Users whose change only the writer's periodic audit found (their hint was lost)",
        )
        self._backend = backend
        self._store = store
        self._debounce = debounce
        self._lease_interval = lease_interval
        self._audit_interval = audit_interval
        self._audit_at: float | None = None  # clock time of the next audit, while leading
        self._auditing = False  # the pending full look is an audit
        self._dirty: set[str] = set()
        self._wakeup = asyncio.Event()
        self._committed: CommittedPresence | None = None  # set while leading
        self._full = False  # next flush looks at every user
        self._window_opened: float | None = None  # epoch seconds
        self._reserved = 0  # highest seq known to be taken from wsMeta
        self._hinted: dict[str, float] = {}  # user -> when the latest hint about them came
        self._tasks: list[asyncio.Task[None]] = []
        self._clock = clock
        self._sleep = sleep

    @property
    def leading(self) -> bool:
        return self._committed is not None

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._lease_loop(), name="presence-lease"),
            asyncio.create_task(self._flush_loop(), name="presence-flush"),
        ]

    async def close(self) -> None:
        await cancel_all_and_wait(self._tasks)
        self._tasks = []

    def hint(self, user_ids: Iterable[str], changed_at: float | None = None) -> None:
        """Some users may have changed; look at them after the debounce window.

        The window opens when the first change of it happened, if known, so the
        time a change spent reaching the writer is not added to its latency.
        """
        if self._committed is None:
            return
        now = self._clock()
        if self._window_opened is None:
            # Clocks of other nodes may be off: trust ``changed_at`` only within a window.
            opened = now if changed_at is None else changed_at
            self._window_opened = min(now, max(opened, now - self._debounce))
        for user_id in user_ids:
            self._dirty.add(user_id)
            self._hinted[user_id] = now
        self._wakeup.set()

    def reconcile(self) -> None:
        """Look at every user, online or committed (after a takeover or node loss)."""
        self._full = True
        self._wakeup.set()

    async def _lease_loop(self) -> None:
        while True:
            try:
                leading = await self._backend.lead()
            except Exception as exc:
                log.warning("presence lease check failed: %s", exc)
                leading = False
            if leading and self._committed is None:
                try:
                    committed = await self._backend.committed()
                    # Numbers a dead writer took from wsMeta but never committed
                    # are used again, so a takeover leaves no gap.
                    self._reserved = await self._store.current_presence_seq()
                except Exception as exc:
                    log.warning("presence writer: loading the committed state failed: %s", exc)
                else:
                    self._committed = committed
                    log.info("presence writer: leading from seq %d", committed.seq)
                    self.reconcile()
                    self._audit_at = self._clock() + self._audit_interval
            elif not leading and self._committed is not None:
                log.info("presence writer: no longer leading")
                self._committed = None
            audit_due = self._audit_at is not None and self._clock() >= self._audit_at
            if self._committed is not None and audit_due:
                self._audit_at = self._clock() + self._audit_interval
                self._auditing = True
                self.reconcile()
            await asyncio.sleep(self._lease_interval)

    async def _flush_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            # Debounce: gather every change of the window into one delta, so a
            # connect and disconnect inside it cancel out.
            opened = self._clock() if self._window_opened is None else self._window_opened
            # Take the window's seq from wsMeta while it is open, so that round
            # trip is not between the window's end and the clients.
            reserving = asyncio.create_task(self._reserve_next_seq())
            try:
                await self._sleep(max(0.0, opened + self._debounce - self._clock()))
                await reserving
            except Exception as exc:
                log.info("presence seq reservation failed; the flush retries it: %s", exc)
            finally:
                reserving.cancel()
            self._window_opened = None
            self._wakeup.clear()
            try:
                await self.flush()
            except Exception as exc:
                self._failures.inc()
                log.warning("presence flush failed, will retry: %s", exc)
                self._wakeup.set()
                await asyncio.sleep(FLUSH_RETRY.delay(1))

    async def _reserve_next_seq(self) -> None:
        committed = self._committed
        if committed is not None and committed.seq + 1 > self._reserved:
            reserved = await self._store.reserve_presence_seq(committed.seq + 1)
            self._reserved = max(self._reserved, reserved)

    async def flush(self) -> None:
        committed = self._committed
        if committed is None:
            self._dirty.clear()
            self._hinted.clear()
            return
        full, self._full = self._full, False
        auditing, self._auditing = self._auditing and full, False
        users: Collection[str] | None
        if full:
            users = None
        else:
            users, self._dirty = self._dirty, set()
        try:
            live = await self._backend.online(users)
            targets: Iterable[str] = set(live) | set(committed.users) if users is None else users
            changes = diff(committed.users, live, targets)
            if auditing:
                self._count_unhinted(changes)
            self._hold_recent_leaves(changes, targets)
            if not changes:
                return
            seq = committed.seq + 1
            if seq > self._reserved:
                # wsMeta is written before the commit, so it never falls behind
                # a seq that a client has seen. It is normally seq itself.
                self._reserved = await self._store.reserve_presence_seq(seq)
                seq = max(seq, self._reserved)
            delta = delta_of(seq, committed.users, changes)
            if not await self._backend.commit(delta, changes):
                log.warning("presence writer fenced out at seq %d", seq)
                self._committed = None
                return
        except BaseException:
            # Nothing is lost: look at the same users again on the next flush.
            if users is None:
                self._full = True
            else:
                self._dirty.update(users)
            raise
        apply_changes(committed.users, changes)
        committed.seq = delta.seq
        self._deltas_committed.inc()

    def _count_unhinted(self, changes: Changes) -> None:
        unhinted = [user for user in changes if user not in self._hinted]
        if unhinted:
            self._unhinted.inc(len(unhinted))
            log.warning(
                "presence audit: %d users changed with no hint heard (lost on the bus?): %s",
                len(unhinted),
                ", ".join(sorted(unhinted)[:10]),
            )

    def _hold_recent_leaves(self, changes: Changes, looked_at: Iterable[str]) -> None:
        """Take out of ``changes`` the users gone offline less than a window ago.

        A window can close between a tab's disconnect and its reconnect (a
        page reload, a node draining its clients towards another node). A user
        is offline only after a whole window without coming back; until then
        they stay dirty, and the next window looks at them again.
        """
        now = self._clock()
        held = 0.0
        for user_id, new in list(changes.items()):
            hinted = self._hinted.get(user_id)
            if new is None and hinted is not None and now - hinted < self._debounce:
                del changes[user_id]
                self._dirty.add(user_id)
                held = max(held, hinted)
        for user_id in looked_at:
            if user_id not in self._dirty:
                self._hinted.pop(user_id, None)
        if held:
            opened = self._window_opened
            self._window_opened = held if opened is None else min(opened, held)
            self._wakeup.set()
