"""Held streams against their history: an event that never arrived is found.

A node notices a hole in a stream only when the stream's next event arrives. The
last event before a quiet spell (a move, then nothing until the opponent answers)
lost on its way, by a subscription that went silent with its connection up, would
leave the node's tabs without it for as long as the game stays quiet. The presence
view check finds such a subscription on the presence channel; on a Redis Cluster
the game and user channels live on other shards, which it cannot see, and on one
Redis a stream's hole would wait for a check of presence.

So every ``interval`` seconds (``--stream-audit-seconds``) the node reads the
position of each stream it holds (one pipelined read per batch; no event moves
unless the node is behind). A stream whose cursor is still short of what the
previous audit found committed (an older epoch, or a lower offset) missed events
committed at least an interval ago, not ones in flight: the delivery fills the
hole from history, as after a reconnect, and ``on_missed`` is told the topic, so
the bus can subscribe it anew.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from protocol.streams import StreamCursor
from server.bus.streams import HistoryAsk, Streams
from server.bus.topics import stream_topic
from server.runtime.metrics import Registry
from server.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

AUDIT_BATCH = 256
"""Streams read in one pipelined round trip."""

Mark = tuple[str, int]
"""A stream's (epoch, top) as an audit found it committed."""


class HeldStreams(Protocol):
    """What the audit needs of the node's delivery (``StreamDelivery`` is one)."""

    @property
    def cursors(self) -> dict[str, StreamCursor]: ...

    def check(self, stream: str) -> None: ...

    def repairing(self, stream: str) -> bool: ...


class StreamAudit:
    """A node's periodic check of its held streams (a :class:`Service`)."""

    def __init__(
        self,
        delivery: HeldStreams,
        streams: Streams,
        metrics: Registry,
        *,
        interval: float,
        on_missed: Callable[[str], None] | None = None,
        batch: int = AUDIT_BATCH,
    ) -> None:
        self._delivery = delivery
        self._streams = streams
        self._on_missed = on_missed
        self._interval = interval
        self._batch = batch
        self._task: asyncio.Task[None] | None = None
        self._missed = metrics.counter(
            "ap_stream_audit_missed_total",
            "Held streams whose committed events never arrived here (then read from history)",
        )

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="stream-audit")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        behind: dict[str, Mark] = {}
        while True:
            await asyncio.sleep(self._interval)
            try:
                behind = await self.audit(behind)
            except Exception as exc:  # Redis away: the reconnect checks every stream anyway
                log.debug("stream audit failed: %s", exc)
                behind = {}

    async def audit(self, behind_before: dict[str, Mark]) -> dict[str, Mark]:
        """One pass: repair the streams still behind what ``behind_before`` found;
        return the streams behind now, for the next pass."""
        cursors = self._delivery.cursors
        held = [stream for stream, cursor in cursors.items() if cursor.epoch is not None]
        behind: dict[str, Mark] = {}
        for start in range(0, len(held), self._batch):
            asks: list[HistoryAsk] = []
            for stream in held[start : start + self._batch]:
                cursor = cursors.get(stream)  # the reads before this one yielded
                if cursor is not None:
                    asks.append((stream, cursor.offset))
            reads = await self._streams.read_many(asks)
            for (stream, _), read in zip(asks, reads, strict=True):
                cursor = cursors.get(stream)
                if cursor is None or (cursor.epoch == read.epoch and cursor.offset >= read.top):
                    continue
                if self._delivery.repairing(stream):
                    continue  # a check under way (this audit's last, or a reconnect's)
                before = behind_before.get(stream)
                if before is not None and (cursor.epoch != before[0] or cursor.offset < before[1]):
                    self._report(stream, before)
                else:
                    behind[stream] = (read.epoch, read.top)
        return behind

    def _report(self, stream: str, mark: Mark) -> None:
        self._missed.inc()
        log.warning("stream %s never heard up to %s/%d: reading its history", stream, *mark)
        self._delivery.check(stream)
        # A new epoch at top 0 published nothing (a read started it after the old
        # one expired): its history says so, and no subscription is to blame.
        if self._on_missed is not None and mark[1] > 0:
            try:
                self._on_missed(stream_topic(stream))
            except Exception:
                log.exception("stream audit callback failed")
