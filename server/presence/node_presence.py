"""One node's part in presence: report its users, keep its view, serve its watchers.

- Its users' transitions (first tab, last tab, visibility) go to the cluster
  through a coalescing flusher: a burst of changes is one report.
- The committed deltas it hears on the bus are applied to its view in seq
  order and sent to its presence watchers, never with a gap: a gap reloads the
  view, and so does a bus reconnect, and either sends every watcher a fresh
  snapshot when the reload changed the view (one the watchers already hold is
  not sent again).
- Its view's seq is compared with the committed one every few seconds: pub/sub
  may lose a delta unnoticed, and a gap shows only when a later delta arrives,
  so the last one before a quiet spell could stay lost for good.
- ``syncPresence`` gets a snapshot, at most one per second per connection.
- A user sent away by a drain stays reported here for the move grace, so that
  their reconnect elsewhere is reported first and nobody sees them flap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Set
from contextlib import AsyncExitStack
from dataclasses import asdict
from typing import Any

from protocol.codec import Frame
from protocol.messages import PresenceDelta
from server.config import Settings
from server.presence.core import (
    LocalPresence,
    PresenceBackend,
    PresenceView,
    PresenceWriter,
)
from server.routing.index import bus_failures
from server.runtime.backoff import Backoff
from server.runtime.metrics import Registry
from server.runtime.tasks import run_until_unwound
from server.runtime.write_behind import CoalescingFlusher
from server.session import Session, send_frame
from server.store.base import Store

log = logging.getLogger(__name__)

RELOAD_BACKOFF = Backoff(first=0.1, cap=1.0, jitter=0.0, attempts=20)
"""Tries to reload presence after a bus reconnect (about 15 s of waits in all)."""
SYNC_PRESENCE_INTERVAL = 1.0
"""Seconds between two snapshots answering one connection's syncPresence."""
VIEW_CHECK_INTERVAL = 5.0
"""Seconds between two comparisons of the view's seq with the committed seq (one
Redis GET). A delta committed before one check and still missing at the next had a
whole interval to arrive: it was lost, and the view is reloaded. So a lost delta
costs at most two intervals, as the writer's audit bounds a lost hint."""


class NodePresence:
    def __init__(
        self,
        settings: Settings,
        backend: PresenceBackend,
        store: Store,
        sessions: Set[Session],
        watchers: Set[Session],
        seen: Callable[[str], None],
        metrics: Registry,
        *,
        check_interval: float = VIEW_CHECK_INTERVAL,
    ) -> None:
        """``sessions`` and ``watchers`` are the hub's live sets (all open sessions,
        and those that want presence); ``seen`` marks a user's lastSeen."""
        self._settings = settings
        self._backend = backend
        self._sessions = sessions
        self._watchers = watchers
        self._seen = seen
        self._outbox_limit = settings.outbox_limit_bytes
        self.local = LocalPresence()
        self.view = PresenceView()
        self.writer = PresenceWriter(backend, store, settings.presence_debounce, metrics=metrics)
        self._reloads = metrics.counter(
            "ap_presence_view_reloads_total", "Times a node reloaded committed presence after a gap"
        )
        self._reloads_current = metrics.counter(
            "ap_presence_reloads_current_total",
            "View reloads that found the view already current (no snapshot sent)",
        )
        self._lost_deltas = metrics.counter(
            "ap_presence_lost_deltas_total",
            "Times the view check found committed deltas this node never heard (then reloaded)",
        )
        self._check_interval = check_interval
        self._lost_delta_callbacks: list[Callable[[], None]] = []
        self._reports: CoalescingFlusher[str, bool | None] = CoalescingFlusher(
            "presence-reports", self._report, lambda _old, new: new, bus_failures(metrics)
        )
        self._reports_since: float | None = None  # when the oldest unreported change happened
        # None asks the delta loop to reload the view and push fresh snapshots.
        self._deltas: asyncio.Queue[PresenceDelta | None] = asyncio.Queue()
        # The highest seq heard on the bus and still queued or in hand (the delta loop
        # lowers it to the view's once nothing waits): the view check must not call
        # a delta lost that merely waits its turn behind a slow reload.
        self._heard_seq = 0
        self._moving = 0  # drained sessions whose user is still reported here
        self._moves_done = asyncio.Event()
        metrics.gauge("ap_users", "Distinct users on this node", self._user_count)
        metrics.gauge("ap_presence_seq", "Seq of this node's presence view", lambda: self.view.seq)

    @property
    def report_backlog(self) -> int:
        """Presence changes of this node's users not yet reported to the cluster."""
        return self._reports.backlog

    def _user_count(self) -> float:
        return float(self.local.user_count)

    async def start(self, stack: AsyncExitStack) -> None:
        """Load the committed view, then start reporting, writing and applying deltas;
        each part's stop goes on ``stack`` as it starts."""
        self.view.reset(await self._backend.committed())
        self._reports.start()
        stack.push_async_callback(self._reports.close)
        self.writer.start()
        stack.push_async_callback(self.writer.close)
        run_until_unwound(stack, self._delta_loop(), "presence-deltas")
        run_until_unwound(stack, self._check_view(), "presence-view-check")

    def on_lost_delta(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the view check finds a delta that never arrived:
        the bus may hold a subscription that silently stopped delivering."""
        self._lost_delta_callbacks.append(callback)

    # --- this node's users ----------------------------------------------------

    def joined(self, user_id: str, invisible: bool) -> None:
        self.local.add(user_id, invisible)
        self._queue_reports()

    def left(self, user_id: str, invisible: bool) -> None:
        self.local.remove(user_id, invisible)
        self._queue_reports()

    def left_for_another_node(self, user_id: str, invisible: bool) -> None:
        """Sent away by the drain: the user counts as online here a while longer,
        for their reconnect to another node to be reported first."""
        self._moving += 1
        grace = self._settings.drain_move_grace_ms / 1000
        asyncio.get_running_loop().call_later(grace, self._moved, user_id, invisible)

    def _moved(self, user_id: str, invisible: bool) -> None:
        self._moving -= 1
        self.left(user_id, invisible)
        if not self._moving:
            self._moves_done.set()

    async def drained(self) -> None:
        """Return once every drained user's grace is over and every change is reported."""
        if self._moving:
            await self._moves_done.wait()
        await self._reports.drained()

    def _queue_reports(self) -> None:
        pending = self.local.take_pending()
        if pending and self._reports_since is None:
            self._reports_since = time.time()
        for user_id, state in pending.items():
            self._reports.put(user_id, state)

    async def _report(self, batch: dict[str, bool | None]) -> dict[str, bool | None]:
        since, self._reports_since = self._reports_since, None
        await self._backend.report(batch, time.time() if since is None else since)
        return {}

    def status(self) -> dict[str, Any]:
        return {
            "seq": self.view.seq,
            "writer": self.writer.leading,
            "online_total": self.view.total,
            "report_backlog": self.report_backlog,
        }

    async def members(self) -> list[dict[str, Any]] | None:
        """The cluster's nodes as the backend knows them; None when it cannot say now."""
        try:
            async with asyncio.timeout(2):
                return [asdict(m) for m in await self._backend.members()]
        except Exception as exc:  # Redis down: the page says so rather than failing
            log.info("status: cluster members unavailable: %s", exc)
            return None

    # --- the view and its watchers --------------------------------------------

    def send_snapshot(self, session: Session) -> None:
        session.send(self.view.snapshot_frame(), self._outbox_limit)

    def sync(self, session: Session) -> None:
        """A snapshot now, or one at the end of the second that the last one opened:
        each costs the whole visible list, so a client asking in a loop gets at
        most one per second, and asks made meanwhile share it."""
        if session.sync_pending:
            return
        loop = asyncio.get_running_loop()
        wait = session.sync_at + SYNC_PRESENCE_INTERVAL - loop.time()
        if wait <= 0:
            self._send_sync(session)
        else:
            session.sync_pending = True
            loop.call_later(wait, self._send_sync, session)

    def _send_sync(self, session: Session) -> None:
        session.sync_pending = False
        session.sync_at = asyncio.get_running_loop().time()
        if session in self._sessions:
            self.send_snapshot(session)
            if session.user_id is not None:
                self._seen(session.user_id)

    def delta(self, delta: PresenceDelta) -> None:
        """A committed delta heard on the bus."""
        if delta.seq > self._heard_seq:
            self._heard_seq = delta.seq
        self._deltas.put_nowait(delta)

    def hint(self, user_ids: Iterable[str], changed_at: float | None) -> None:
        """Users whose presence may have changed somewhere: for the writer, if it leads."""
        self.writer.hint(user_ids, changed_at)

    def resync(self) -> None:
        """The bus reconnected and may have lost messages: reload the view and, if
        it changed, send every presence watcher a fresh snapshot; the writer looks
        at everyone."""
        self._deltas.put_nowait(None)
        self.writer.reconcile()

    async def _delta_loop(self) -> None:
        while True:
            delta = await self._deltas.get()
            if delta is None:
                await self._reload_view()
            elif delta.seq > self.view.seq:  # else a reload got ahead of it
                await self._apply_heard(delta)
            if self._deltas.empty():
                # Nothing heard is waiting: whatever the view lacks now never came
                # (or was dropped after a failed reload), for the view check to find.
                self._heard_seq = self.view.seq

    async def _apply_heard(self, delta: PresenceDelta) -> None:
        if delta.seq == self.view.seq + 1:
            self.view.apply(delta)
            send_frame(self._watchers, Frame(delta), self._outbox_limit)
            return
        # A gap in what this node heard: read the committed state again, and give
        # the watchers that state as one snapshot. Passing the delta on would show
        # each of them the gap, and each would ask for the same snapshot with
        # syncPresence (a round trip, and up to a second of its rate limit).
        self._reloads.inc()
        log.warning("presence gap at node: have %d, got %d", self.view.seq, delta.seq)
        try:
            changed = self.view.reset(await self._backend.committed())
        except Exception as exc:
            # The view and its watchers stay where they were, gap-free; the next
            # delta, or the view check, reloads again.
            log.warning("presence reload failed: %s", exc)
            return
        if delta.seq == self.view.seq + 1:  # the committed state was read before it
            self.view.apply(delta)
            changed = True
        self._snapshot_if_changed(changed)

    async def _check_view(self) -> None:
        behind_at: int | None = None  # committed seq the view lacked at the last check
        while True:
            await asyncio.sleep(self._check_interval)
            try:
                committed = await self._backend.committed_seq()
            except Exception as exc:  # Redis away: the reconnect reloads anyway
                log.debug("presence view check failed: %s", exc)
                behind_at = None
                continue
            heard = max(self.view.seq, self._heard_seq)
            if committed is None or committed <= heard:
                behind_at = None
            elif behind_at is not None and heard < behind_at:
                self._lost_deltas.inc()
                log.warning(
                    "presence view at seq %d never heard the deltas up to %d: reloading",
                    self.view.seq,
                    behind_at,
                )
                self._deltas.put_nowait(None)
                behind_at = None
                for callback in self._lost_delta_callbacks:
                    try:
                        callback()
                    except Exception:
                        log.exception("lost-delta callback failed")
            else:
                behind_at = committed

    async def _reload_view(self) -> None:
        self._reloads.inc()
        # Right after a reconnect Redis may still refuse (a cluster still
        # electing, a client on a stale slot map): retry rather than leave the
        # watchers without the snapshot that covers what they missed.
        retrying = RELOAD_BACKOFF.start()
        while True:
            try:
                changed = self.view.reset(await self._backend.committed())
                break
            except Exception as exc:
                if not await retrying.wait():
                    log.warning("presence reload after a bus reconnect failed: %s", exc)
                    return
        self._snapshot_if_changed(changed)

    def _snapshot_if_changed(self, changed: bool) -> None:
        """After a reload: the view's snapshot to every watcher, unless the reload
        changed nothing. The watchers were sent every change the view took, so
        they hold that state already, and a snapshot of every online user to each
        of them (a burst of users x watchers bytes) would tell them nothing. A
        watcher that saw a gap asks with syncPresence."""
        if changed:
            send_frame(self._watchers, self.view.snapshot_frame(), self._outbox_limit)
        else:
            self._reloads_current.inc()
