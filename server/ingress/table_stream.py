"""Read the table's DynamoDB Stream: one reader in the cluster, durable checkpoints.

Used by the notification push (``server/ingress/notifications.py``), which
hands in a function that takes a batch of records and publishes what matters.

- **One reader.** The node holding the lease (``server/coordination/lease.py``) reads; the
  others wait. Each new reader takes a fence number from the table
  (``wsMeta/notificationStream``, ``docs/access-patterns.md``), and every
  checkpoint it writes carries it: a stale reader (a long pause, a Redis
  restart) cannot move a newer reader's checkpoint.
- **Checkpoints in the table**, one row per shard (``wsMeta/streamShard#<id>``),
  never in Redis, which may lose its data. A batch with something relevant is
  published first and checkpointed after (at-least-once at the boundary); the
  handler makes publishing idempotent per record, so a restart or a handover
  between the two steps pushes nothing twice. Batches of other records are
  checkpointed at most every few seconds: re-reading them costs nothing.
- **Where to start.** The very first reader of a stream starts at LATEST, so a
  first deploy does not replay a day of old rows; records older than that first
  start are never handed on, wherever a later reader starts.
- **Shards.** Shards are re-listed every few seconds. A child shard is read only
  once its parent was read to its end (the order of one item's changes is kept),
  and a closed shard's end is checkpointed as ``done``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aioboto3
from botocore.exceptions import ClientError

from server.aws import client_config
from server.coordination.lease import Lease, LeaseState
from server.runtime.backoff import Backoff
from server.runtime.metrics import Registry
from server.runtime.tasks import cancel_all_and_wait, cancel_and_wait
from server.store.base import Fenced, ShardCheckpoint, Store, StreamReaderState

log = logging.getLogger(__name__)

Record = dict[str, Any]
RecordHandler = Callable[[Sequence[Record]], Awaitable[int]]
"""Publishes what matters in a batch; returns how many records mattered. Raises to have
the same batch handed in again later (nothing is skipped)."""

GET_RECORDS_LIMIT = 1000
REDISCOVER_SECONDS = 5.0
"""How often shards are listed again (DescribeStream allows 10 calls/s per account)."""
IDLE_CHECKPOINT_SECONDS = 10.0
RENEW_SECONDS = 1.0
BACKOFF = Backoff(first=0.4, cap=5.0)
"""Between two tries of a failed read or delivery."""


class _ReaderCounters:
    """The reader's counters, on its node's registry."""

    def __init__(self, registry: Registry) -> None:
        self.records_read = registry.counter("ap_stream_records_total", "Table stream records read")
        self.checkpoints_written = registry.counter(
            "ap_stream_checkpoints_total", "Shard checkpoints written to the table"
        )
        self.reader_failures = registry.counter(
            "ap_stream_reader_failures_total",
            "Stream reads or deliveries that failed and were retried",
        )


class LeaseLost(Exception):
    """The lease ran out while reading: stop before publishing anything more."""


# --- which shards to read, from where ------------------------------------------


@dataclass(frozen=True, slots=True)
class Shard:
    shard_id: str
    parent_id: str | None
    closed: bool
    """It has an ending sequence number: no new records will come."""


class Start(enum.Enum):
    LATEST = "LATEST"
    TRIM_HORIZON = "TRIM_HORIZON"
    AFTER = "AFTER_SEQUENCE_NUMBER"


@dataclass(frozen=True, slots=True)
class Position:
    start: Start
    sequence_number: str | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    read: dict[str, Position]
    """Shards to start reading now, and where."""
    finished: set[str]
    """Shards with nothing to read (first start, or a descendant is further on) to
    checkpoint as done, so that later plans skip them without reading."""


def plan_shards(
    shards: Sequence[Shard],
    checkpoints: Mapping[str, ShardCheckpoint],
    *,
    fresh: bool,
    running: frozenset[str] = frozenset(),
) -> Plan:
    """Decide, from the listed shards and the checkpoints, what to read next."""
    by_id = {shard.shard_id: shard for shard in shards}
    read: dict[str, Position] = {}
    finished: set[str] = set()
    if fresh:
        for shard in shards:
            if shard.shard_id in running:
                continue
            if shard.closed:
                finished.add(shard.shard_id)
            else:
                read[shard.shard_id] = Position(Start.LATEST)
        return Plan(read, finished)

    children: dict[str, list[str]] = {}
    for shard in shards:
        if shard.parent_id is not None:
            children.setdefault(shard.parent_id, []).append(shard.shard_id)

    def has_checkpointed_descendant(shard_id: str) -> bool:
        stack = list(children.get(shard_id, ()))
        while stack:
            child = stack.pop()
            if child in checkpoints or child in running:
                return True
            stack.extend(children.get(child, ()))
        return False

    def is_finished(shard_id: str) -> bool:
        checkpoint = checkpoints.get(shard_id)
        if checkpoint is not None:
            return checkpoint.done
        return has_checkpointed_descendant(shard_id)

    for shard in shards:
        sid = shard.shard_id
        if sid in running:
            continue
        checkpoint = checkpoints.get(sid)
        if checkpoint is not None:
            if checkpoint.done:
                continue
            if checkpoint.sequence_number is not None:
                read[sid] = Position(Start.AFTER, checkpoint.sequence_number)
            else:
                # Opened at LATEST and never saw a record: from its start, and the
                # first-start cutoff drops what came before.
                read[sid] = Position(Start.TRIM_HORIZON)
            continue
        if has_checkpointed_descendant(sid):
            finished.add(sid)
            continue
        parent = shard.parent_id
        if parent is not None and parent in by_id and not is_finished(parent):
            continue  # the parent first: one item's changes stay in order
        read[sid] = Position(Start.TRIM_HORIZON)
    return Plan(read, finished)


def _shards_of(description: Mapping[str, Any]) -> list[Shard]:
    return [
        Shard(
            shard_id=raw["ShardId"],
            parent_id=raw.get("ParentShardId"),
            closed="EndingSequenceNumber" in raw.get("SequenceNumberRange", {}),
        )
        for raw in description.get("Shards", [])
    ]


def _created_ms(record: Record) -> float | None:
    raw = record.get("dynamodb", {}).get("ApproximateCreationDateTime")
    if isinstance(raw, datetime.datetime):
        return raw.timestamp() * 1000
    if isinstance(raw, int | float):
        return float(raw) * 1000
    return None


# --- the reader -----------------------------------------------------------------


class TableStreamReader:
    def __init__(
        self,
        store: Store,
        lease: Lease,
        handler: RecordHandler,
        *,
        table: str,
        region: str,
        endpoint_url: str | None,
        poll_seconds: float = 0.5,
        metrics: Registry | None = None,
    ) -> None:
        self._metrics = metrics or Registry()
        self._counts = _ReaderCounters(self._metrics)
        self._store = store
        self._lease = lease
        self._handler = handler
        self._table = table
        self._region = region
        self._endpoint_url = endpoint_url
        self._poll = poll_seconds
        self._stack: contextlib.AsyncExitStack | None = None
        self._tables: Any = None
        self._streams: Any = None
        self._lead_task: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._checkpoints: dict[str, ShardCheckpoint] = {}
        self.reading = False
        self.positioned: set[str] = set()
        """Shards this term holds an iterator on: records written from now on are read."""
        self._metrics.gauge(
            "ap_stream_reader_active", "1 while this node reads the table's stream", self._active
        )

    def _active(self) -> float:
        return 1.0 if self.reading else 0.0

    async def start(self) -> None:
        stack = contextlib.AsyncExitStack()
        session = aioboto3.Session()
        config = client_config(
            connect_timeout=2,
            read_timeout=10,
            retries={"mode": "standard", "total_max_attempts": 1},  # our loops retry
        )
        for service in ("dynamodb", "dynamodbstreams"):
            client = await stack.enter_async_context(
                session.client(
                    service,
                    region_name=self._region,
                    endpoint_url=self._endpoint_url,
                    config=config,
                )
            )
            if service == "dynamodb":
                self._tables = client
            else:
                self._streams = client
        self._stack = stack
        self._lead_task = asyncio.create_task(self._lead(), name="stream-lease")

    async def stop(self) -> None:
        await cancel_all_and_wait((self._lead_task, self._reader))
        self._lead_task = self._reader = None
        self.reading = False
        with contextlib.suppress(Exception):
            await self._lease.release()
        await self._lease.close()
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    # --- the lease ----------------------------------------------------------

    async def _lead(self) -> None:
        """Renew the lease; read while it is ours, stop at once when it is not."""
        while True:
            try:
                state = await self._lease.renew()
            except Exception as exc:
                log.warning("stream reader: lease renewal failed: %s", exc)
                state = None  # unknown: the shard loops stop when the lease runs out
            if state is LeaseState.LOST:
                await self._stop_reading("another node holds the stream lease")
            elif state is LeaseState.ACQUIRED or (
                state is LeaseState.RENEWED and (self._reader is None or self._reader.done())
            ):
                # A new term: whatever an earlier holder did is read back from the table.
                await self._stop_reading(None)
                self._reader = asyncio.create_task(self._read(), name="stream-reader")
            await asyncio.sleep(RENEW_SECONDS)

    async def _stop_reading(self, reason: str | None) -> None:
        task, self._reader = self._reader, None
        if task is None:
            return
        if reason is not None and not task.done():
            log.info("stream reader: stopping: %s", reason)
        with contextlib.suppress(Exception):
            await cancel_and_wait(task)

    def _check_lease(self) -> None:
        if time.monotonic() >= self._lease.valid_until:
            raise LeaseLost("the stream lease ran out")

    # --- one term of reading -------------------------------------------------

    async def _read(self) -> None:
        retrying = BACKOFF.start()
        while True:
            try:
                await self._read_term()
                return
            except (LeaseLost, Fenced) as exc:
                log.warning("stream reader: stopped: %s", exc)
                self.reading = False
                return
            except Exception as exc:
                self._counts.reader_failures.inc()
                delay = retrying.next_delay()
                assert delay is not None  # no limit: the reader retries while it holds the lease
                log.warning("stream reader failed (%s); again in %.1fs", exc, delay)
                self.reading = False
                await asyncio.sleep(delay)

    async def _read_term(self) -> None:
        arn = await self._stream_arn()
        state = await self._store.take_stream_fence(arn, int(time.time() * 1000))
        self._checkpoints = await self._store.stream_checkpoints(arn)
        fresh = state.fresh and not self._checkpoints
        log.info(
            "stream reader: reading %s with fence %d%s (%d shard checkpoints)",
            arn,
            state.fence,
            ", first start: from the latest record" if fresh else "",
            len(self._checkpoints),
        )
        self.reading = True
        running: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                self._check_lease()
                shards = await self._describe(arn)
                plan = plan_shards(
                    shards, self._checkpoints, fresh=fresh, running=frozenset(running)
                )
                fresh = False
                for shard_id in sorted(plan.finished):
                    if shard_id not in self._checkpoints:
                        await self._save(arn, ShardCheckpoint(shard_id, None, True), state)
                for shard_id, position in plan.read.items():
                    running[shard_id] = asyncio.create_task(
                        self._read_shard(arn, shard_id, position, state),
                        name=f"stream-shard-{shard_id}",
                    )
                if not running:
                    await asyncio.sleep(REDISCOVER_SECONDS)
                    continue
                done, _ = await asyncio.wait(
                    running.values(),
                    timeout=REDISCOVER_SECONDS,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for shard_id, task in list(running.items()):
                    if task in done:
                        del running[shard_id]
                        error = task.exception()
                        if isinstance(error, LeaseLost | Fenced):
                            raise error
                        if error is not None:
                            # Re-planned from its checkpoint on the next round.
                            self._counts.reader_failures.inc()
                            log.warning("stream reader: shard %s failed: %s", shard_id, error)
                            await asyncio.sleep(BACKOFF.delay(1))
        finally:
            self.reading = False
            self.positioned.clear()
            with contextlib.suppress(Exception):
                await cancel_all_and_wait(running.values())

    async def _stream_arn(self) -> str:
        response = await self._tables.describe_table(TableName=self._table)
        arn = response.get("Table", {}).get("LatestStreamArn")
        spec = response.get("Table", {}).get("StreamSpecification", {})
        if not arn or not spec.get("StreamEnabled", False):
            raise RuntimeError(
                f"table {self._table!r} has no stream: enable it (NEW_AND_OLD_IMAGES)"
            )
        view = spec.get("StreamViewType")
        if view not in ("NEW_IMAGE", "NEW_AND_OLD_IMAGES"):
            raise RuntimeError(f"the stream of {self._table!r} is {view}: new images are needed")
        return str(arn)

    async def _describe(self, arn: str) -> list[Shard]:
        shards: list[Shard] = []
        params: dict[str, Any] = {"StreamArn": arn}
        while True:
            response = await self._streams.describe_stream(**params)
            description = response.get("StreamDescription", {})
            shards += _shards_of(description)
            last = description.get("LastEvaluatedShardId")
            if not last:
                return shards
            params["ExclusiveStartShardId"] = last

    async def _save(self, arn: str, checkpoint: ShardCheckpoint, state: StreamReaderState) -> None:
        self._check_lease()
        await self._store.save_stream_checkpoint(arn, checkpoint, state.fence)
        self._checkpoints[checkpoint.shard_id] = checkpoint
        self._counts.checkpoints_written.inc()

    async def _iterator(self, arn: str, shard_id: str, position: Position) -> str:
        params: dict[str, Any] = {
            "StreamArn": arn,
            "ShardId": shard_id,
            "ShardIteratorType": position.start.value,
        }
        if position.sequence_number is not None:
            params["SequenceNumber"] = position.sequence_number
        response = await self._streams.get_shard_iterator(**params)
        return str(response["ShardIterator"])

    async def _read_shard(
        self, arn: str, shard_id: str, position: Position, state: StreamReaderState
    ) -> None:
        iterator: str | None = await self._iterator(arn, shard_id, position)
        self.positioned.add(shard_id)
        log.info("stream reader: reading shard %s from %s", shard_id, position.start.value)
        last = position.sequence_number
        unsaved_since: float | None = None
        cutoff_ms = (state.started_at_ms // 1000) * 1000  # creation times are whole seconds
        while iterator is not None:
            self._check_lease()
            try:
                response = await self._streams.get_records(
                    ShardIterator=iterator, Limit=GET_RECORDS_LIMIT
                )
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if code != "ExpiredIteratorException":
                    raise
                # Iterators live 15 minutes: take a new one where we are.
                again = Position(Start.AFTER, last) if last is not None else position
                iterator = await self._iterator(arn, shard_id, again)
                continue
            records: list[Record] = response.get("Records", [])
            if records:
                self._counts.records_read.inc(len(records))
                fresh_records = [r for r in records if (_created_ms(r) or cutoff_ms) >= cutoff_ms]
                relevant = await self._deliver(fresh_records)
                last = records[-1]["dynamodb"]["SequenceNumber"]
                if relevant:
                    await self._save(arn, ShardCheckpoint(shard_id, last, False), state)
                    unsaved_since = None
                elif unsaved_since is None:
                    unsaved_since = time.monotonic()
            if unsaved_since is not None and time.monotonic() - unsaved_since > (
                IDLE_CHECKPOINT_SECONDS
            ):
                await self._save(arn, ShardCheckpoint(shard_id, last, False), state)
                unsaved_since = None
            iterator = response.get("NextShardIterator")
            if iterator is not None and not records:
                await asyncio.sleep(self._poll)
        # The shard is closed and read to its end: its children may start.
        await self._save(arn, ShardCheckpoint(shard_id, last, True), state)
        log.info("stream reader: shard %s read to its end", shard_id)

    async def _deliver(self, records: Sequence[Record]) -> int:
        """Hand a batch on until it is taken; nothing after it is read meanwhile."""
        retrying = BACKOFF.start()
        while True:
            self._check_lease()
            try:
                return await self._handler(records) if records else 0
            except (LeaseLost, Fenced):
                raise
            except Exception as exc:
                self._counts.reader_failures.inc()
                delay = retrying.next_delay()
                assert delay is not None  # no limit: the lease check above ends it
                if retrying.failures == 1 or retrying.failures % 10 == 0:
                    log.warning("stream reader: delivery failed (%s); again in %.1fs", exc, delay)
                await asyncio.sleep(delay)
