"""The node's history reads, in batches: one round trip carries many streams.

A reconnect storm asks for tens of thousands of history reads at once (every
returning client, each of its streams), mostly of the same few streams at the
same offset. Asks made while earlier batches are out wait for the next batch,
which goes to ``Streams.read_many`` as one pipelined round trip; asks of one
batch for the same stream at the same offset share its read and its decoding.

A read is never shared with one already sent: each asker must get the history
as it is after it subscribed (the merge in ``protocol.streams`` relies on it).

Asks queue here, where they wait as long as it takes (live events are buffered
meanwhile), not in a Redis connection pool, whose waiters fail after its timeout
and would turn a slow recovery into ``recovered: false``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

from protocol.envelope import EnvelopeError, decode_envelope
from protocol.messages import Broadcast
from protocol.streams import HistoryRead
from server.bus.streams import HistoryAsk, Streams
from server.runtime.backoff import Backoff
from server.runtime.metrics import Registry
from server.runtime.tasks import cancel_all_and_wait

READ_BATCH = 256
"""Most streams in one round trip: at the default history size (50) a full batch
is a reply of a few MB at worst, and Redis runs it in a few ms."""
BATCHES_IN_FLIGHT = 2
"""Batches asked for at once: one is decoded while the next is answered (on one
Redis the next goes out as the reply to the one before arrives)."""
DECODED_CACHE = 16384
"""Decoded events kept, least recently used out: a storm reads the same streams
again and again, and an event's bytes at one position never change."""
PATIENCE_S = 30.0
"""How long a recovery or a repair tries its history read again while Redis is
away (``--history-patience-seconds``): past a restart or a failover, short of
leaving a tab waiting."""
PATIENT_BACKOFF = Backoff(first=0.05, cap=1.0)
"""Between those tries: jittered, so the nodes of a restarted Redis do not all
read again in step."""

log = logging.getLogger(__name__)

DecodedRead = HistoryRead[Broadcast]


class HistoryReads:
    def __init__(
        self,
        streams: Streams,
        batch_size: int = READ_BATCH,
        in_flight: int = BATCHES_IN_FLIGHT,
        *,
        patience: float = PATIENCE_S,
        metrics: Registry | None = None,
    ) -> None:
        registry = metrics or Registry()
        self._batches_read = registry.counter(
            "ap_stream_history_batches_total", "Round trips that read stream histories"
        )
        self._reads = registry.counter(
            "ap_stream_history_reads_total", "Stream histories read (after sharing within a batch)"
        )
        self._patient_retries = registry.counter(
            "ap_stream_history_retries_total", "History reads tried again because Redis was away"
        )
        self._streams = streams
        self._batch_size = batch_size
        self._max_in_flight = in_flight
        self._patience = patience
        self._queued: dict[HistoryAsk, asyncio.Future[DecodedRead]] = {}
        self._batches: set[asyncio.Task[None]] = set()
        self._scheduled = False
        self._decoded: OrderedDict[tuple[str, str, int], Broadcast] = OrderedDict()

    async def read(self, stream: str, after: int) -> DecodedRead:
        """The stream's history after ``after``, decoded, read after this call."""
        # Shielded: one asker going away must not cancel the read for the others.
        return await asyncio.shield(self._ask((stream, after)))

    async def read_each(self, asks: Sequence[HistoryAsk]) -> list[DecodedRead | BaseException]:
        """``read`` for every ask, their errors in their places (a cancelled read
        is a ``CancelledError``): what ``gather(..., return_exceptions=True)``
        of ``read`` answers, for one waiter instead of a task and a shield per
        stream (a recovering client asks for all of its streams at once)."""
        futures = [self._ask(ask) for ask in asks]
        pending = [future for future in futures if not future.done()]
        if pending:
            # One waiter; cancelled, it leaves the shared reads running for the others.
            await asyncio.wait(pending)
        return [_outcome(future) for future in futures]

    def _ask(self, ask: HistoryAsk) -> asyncio.Future[DecodedRead]:
        """The future of ``ask``'s read in the next batch (shared by its asks)."""
        future = self._queued.get(ask)
        if future is None:
            future = self._queued[ask] = asyncio.get_running_loop().create_future()
            future.add_done_callback(_retrieve)
            if not self._scheduled and len(self._batches) < self._max_in_flight:
                # At the end of this loop turn: asks of the same turn share the batch.
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._send)
        return future

    async def read_patiently(self, stream: str, after: int) -> DecodedRead | None:
        """``read``, tried again while Redis is away (a restart, a failover, a
        blackhole) for up to ``patience`` seconds: an answer built without the
        history could only guess the stream's epoch and top. None if it never came."""
        within = self._patience
        retrying = PATIENT_BACKOFF.start(deadline=time.monotonic() + within)
        while True:
            try:
                return await self.read(stream, after)
            except Exception as exc:
                if not await retrying.wait():
                    log.warning("history of %s unreadable for %gs: %s", stream, within, exc)
                    return None
                self._patient_retries.inc()

    @property
    def queued(self) -> int:
        return len(self._queued)

    def _send(self) -> None:
        self._scheduled = False
        while self._queued and len(self._batches) < self._max_in_flight:
            batch: dict[HistoryAsk, asyncio.Future[DecodedRead]] = {}
            for ask in list(self._queued)[: self._batch_size]:
                batch[ask] = self._queued.pop(ask)
            task = asyncio.create_task(self._read_batch(batch), name="history-reads")
            self._batches.add(task)
            task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._batches.discard(task)
        if self._queued and not self._scheduled:
            self._send()

    async def _read_batch(self, batch: dict[HistoryAsk, asyncio.Future[DecodedRead]]) -> None:
        self._batches_read.inc()
        self._reads.inc(len(batch))
        try:
            reads = await self._streams.read_many(list(batch))
        except BaseException as exc:
            for future in batch.values():
                if not future.done():
                    if isinstance(exc, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (stream, _), future, read in zip(batch, batch.values(), reads, strict=True):
            if not future.done():
                entries = self._decode(stream, read.epoch, read.entries)
                future.set_result(HistoryRead(read.epoch, read.top, entries))

    def _decode(
        self, stream: str, epoch: str, entries: Sequence[tuple[int, bytes]]
    ) -> tuple[tuple[int, Broadcast], ...]:
        """History entries as messages; one that cannot be read ends the run (a hole)."""
        cache = self._decoded
        decoded: list[tuple[int, Broadcast]] = []
        for offset, data in entries:
            key = (stream, epoch, offset)
            message = cache.get(key)
            if message is not None:
                cache.move_to_end(key)
            else:
                message = _decode_one(data)
                if message is None:
                    break
                cache[key] = message
                if len(cache) > DECODED_CACHE:
                    cache.popitem(last=False)
            decoded.append((offset, message))
        return tuple(decoded)

    async def close(self) -> None:
        for future in self._queued.values():
            future.cancel()
        self._queued.clear()
        await cancel_all_and_wait(list(self._batches))


def _retrieve(future: asyncio.Future[DecodedRead]) -> None:
    """Every asker may have gone: the error is not worth a "never retrieved" log."""
    if not future.cancelled():
        future.exception()


def _outcome(future: asyncio.Future[DecodedRead]) -> DecodedRead | BaseException:
    if future.cancelled():
        return asyncio.CancelledError()
    return future.exception() or future.result()


def _decode_one(data: bytes) -> Broadcast | None:
    try:
        envelope = decode_envelope(data)
    except EnvelopeError:
        return None
    return envelope if isinstance(envelope, Broadcast) else None
