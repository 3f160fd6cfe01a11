"""``USERS.lastSeen``, kept as the newer backend's ``touchUserLastSeen`` keeps it.

A user seen on ``subscribe`` or ``syncPresence`` gets ``lastSeen = now`` when it
is missing or older than 15 minutes, so the abandoned-game check does not take
active players for gone. Nothing waits for it: ``seen`` only queues. Writes are
at most one per user per 15 minutes across the cluster: this node skips users it
queued recently, a cluster-wide claim (Redis ``SET NX PX``) picks one node, and
the conditional update itself refuses a write that is not needed.

A connect storm queues thousands at once: they go in chunks of ``BATCH`` (one
pipelined claim round trip, one store request each), and each chunk waits
for a quiet loop (``Pacer``) so the writes use the CPU fan-out leaves over.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from server.coordination.claims import Claims
from server.runtime.metrics import Registry
from server.runtime.pacer import Pacer
from server.runtime.write_behind import CoalescingFlusher, WriteBehind
from server.store.base import Store
from server.store.records import LAST_SEEN_INTERVAL_MS

INTERVAL_SECONDS = LAST_SEEN_INTERVAL_MS / 1000
BATCH = 25
"""Users per claim round trip and per store request (``touch_last_seen_many``)."""


@dataclass(frozen=True, slots=True)
class Touch:
    at_ms: int
    claimed: bool = False  # this node holds the cluster-wide claim (a retry keeps it)


def _merge(older: Touch, newer: Touch) -> Touch:
    return Touch(max(older.at_ms, newer.at_ms), older.claimed or newer.claimed)


class LastSeen(WriteBehind[str, Touch]):
    def __init__(
        self,
        store: Store,
        claims: Claims,
        metrics: Registry | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        registry = metrics or Registry()
        self._writes = registry.counter(
            "ap_last_seen_writes_total", "Conditional USERS.lastSeen updates sent"
        )
        self._requests = registry.counter(
            "ap_last_seen_requests_total", "Store requests carrying USERS.lastSeen updates"
        )
        self._pacer = pacer or Pacer()
        retries = registry.counter(
            "ap_last_seen_retries_total", "USERS.lastSeen updates that failed and were queued again"
        )
        self._store = store
        self._claims = claims
        self._queued_at: dict[str, float] = {}
        self._flusher: CoalescingFlusher[str, Touch] = CoalescingFlusher(
            "last-seen", self._flush, _merge, retries
        )

    async def close(self) -> None:
        await super().close()
        await self._claims.close()

    def seen(self, user_id: str) -> None:
        """The user is active now. Returns at once; the write (if any) happens later."""
        now = time.monotonic()
        if self._queued_at.get(user_id, -INTERVAL_SECONDS) > now - INTERVAL_SECONDS:
            return
        self._queued_at[user_id] = now
        if len(self._queued_at) > 100_000:
            horizon = now - INTERVAL_SECONDS
            self._queued_at = {u: t for u, t in self._queued_at.items() if t > horizon}
        self._flusher.put(user_id, Touch(time.time_ns() // 1_000_000))

    async def _flush(self, batch: dict[str, Touch]) -> dict[str, Touch]:
        """In chunks of ``BATCH``, each behind the pacer: one pipelined claim round
        trip, then one store request for the users this node won."""
        failed: dict[str, Touch] = {}
        pending = list(batch.items())
        for start in range(0, len(pending), BATCH):
            chunk = dict(pending[start : start + BATCH])
            await self._pacer.turn()
            try:
                unclaimed = [user for user, job in chunk.items() if not job.claimed]
                # a name not won: another node (or an earlier run) wrote it lately
                won = (
                    await self._claims.claim_many(unclaimed, INTERVAL_SECONDS)
                    if unclaimed
                    else set()
                )
                jobs = {
                    user: Touch(job.at_ms, claimed=True)
                    for user, job in chunk.items()
                    if job.claimed or user in won
                }
            except Exception:
                failed.update(chunk)
                continue
            if not jobs:
                continue
            self._writes.inc(len(jobs))
            self._requests.inc()
            try:
                await self._store.touch_last_seen_many({u: job.at_ms for u, job in jobs.items()})
            except Exception:
                failed.update(jobs)
        return failed
