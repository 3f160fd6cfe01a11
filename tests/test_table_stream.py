"""The table-stream reader: shard planning, and reading moto's DynamoDB Stream over HTTP.

The reader here hands records to a recording handler; the notification push on
top of it, over real sockets, is tested in ``test_notifications.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from server.coordination.lease import Lease, MemoryLease, RedisLease
from server.ingress.table_stream import (
    Plan,
    Position,
    Record,
    Shard,
    Start,
    TableStreamReader,
    plan_shards,
)
from server.redis.client import make_client
from server.runtime.metrics import Registry
from server.store.base import ShardCheckpoint
from server.store.dynamodb import DynamoStore
from tests.conftest import TEST_REGION, new_table
from tests.services import redis_url_for_tests
from tests.waiting import eventually

WITHIN_S = 120.0
"""How long a reader may take to get somewhere over moto. A run beside busy loops and
the chaos soak, all sharing one moto, once took over 30 s for a handover; a reader
that never gets there still fails, a slow machine only waits longer."""

# --- planning (pure) -------------------------------------------------------------
# Splits and closed shards are tested here, on the planner, and not over HTTP: moto's
# DynamoDB Streams has one shard per table that never closes or splits (no parent, no
# ending sequence number: moto/dynamodb/models/table.py, ``StreamShard``), so only
# these pure tests can give the reader a parent and its children.


def cp(shard: str, seq: str | None = "5", done: bool = False) -> ShardCheckpoint:
    return ShardCheckpoint(shard, seq, done)


def test_a_first_start_reads_open_shards_from_the_latest_and_skips_closed_ones() -> None:
    shards = [Shard("a", None, True), Shard("b", "a", False), Shard("c", None, False)]
    assert plan_shards(shards, {}, fresh=True) == Plan(
        {"b": Position(Start.LATEST), "c": Position(Start.LATEST)}, {"a"}
    )


def test_checkpointed_shards_resume_after_their_sequence_number() -> None:
    shards = [Shard("a", None, False)]
    assert plan_shards(shards, {"a": cp("a", "42")}, fresh=False).read == {
        "a": Position(Start.AFTER, "42")
    }


def test_a_child_waits_for_its_parent_then_reads_from_its_start() -> None:
    shards = [Shard("p", None, True), Shard("c1", "p", False), Shard("c2", "p", False)]
    waiting = plan_shards(shards, {"p": cp("p", "9")}, fresh=False)
    assert waiting.read == {"p": Position(Start.AFTER, "9")}
    after = plan_shards(shards, {"p": cp("p", "12", done=True)}, fresh=False)
    assert after.read == {"c1": Position(Start.TRIM_HORIZON), "c2": Position(Start.TRIM_HORIZON)}


def test_a_trimmed_parent_does_not_block_its_child() -> None:
    plan = plan_shards([Shard("c", "gone", False)], {}, fresh=False)
    assert plan.read == {"c": Position(Start.TRIM_HORIZON)}


def test_ancestors_of_a_checkpointed_shard_are_finished_without_reading() -> None:
    shards = [Shard("g", None, True), Shard("p", "g", True), Shard("c", "p", False)]
    plan = plan_shards(shards, {"c": cp("c", "77")}, fresh=False)
    assert plan == Plan({"c": Position(Start.AFTER, "77")}, {"g", "p"})


def test_a_shard_opened_at_latest_that_saw_nothing_is_read_from_its_start() -> None:
    plan = plan_shards([Shard("a", None, False)], {"a": cp("a", None)}, fresh=False)
    assert plan.read == {"a": Position(Start.TRIM_HORIZON)}


def test_running_and_done_shards_are_left_alone() -> None:
    shards = [Shard("a", None, True), Shard("b", "a", False)]
    plan = plan_shards(shards, {"a": cp("a", done=True)}, fresh=False, running=frozenset({"b"}))
    assert plan == Plan({}, set())


# --- reading moto's stream ---------------------------------------------------------


def enable_stream(raw: Any, table: str) -> None:
    raw.update_table(
        TableName=table,
        StreamSpecification={"StreamEnabled": True, "StreamViewType": "NEW_AND_OLD_IMAGES"},
    )


def put_notification(raw: Any, table: str, user: str, n: int) -> str:
    sk = f"{int(time.time() * 1000)}#{uuid.uuid4().hex[:8]}"
    raw.put_item(
        TableName=table,
        Item={
            "pk": {"S": f"NOTIFICATION#{user}"},
            "sk": {"S": sk},
            "body": {"M": {"type": {"S": "gameEnd"}, "n": {"N": str(n)}}},
            "expiresAt": {"N": str(int(time.time()) + 180 * 86400)},
        },
    )
    return sk


class Recorder:
    """A handler that keeps every record, and says each notification row mattered."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    async def __call__(self, records: Sequence[Record]) -> int:
        self.records.extend(records)
        return sum(1 for r in records if r["dynamodb"]["Keys"]["pk"]["S"].startswith("NOTIF"))

    def numbers(self) -> list[int]:
        return [
            int(r["dynamodb"]["NewImage"]["body"]["M"]["n"]["N"])
            for r in self.records
            if r["eventName"] == "INSERT" and "body" in r["dynamodb"].get("NewImage", {})
        ]


@pytest.fixture
async def unstreamed(dynamodb_endpoint: str) -> AsyncIterator[tuple[str, DynamoStore]]:
    table = await new_table(dynamodb_endpoint)
    store = DynamoStore(table=table, region=TEST_REGION, endpoint_url=dynamodb_endpoint)
    await store.start()
    try:
        yield table, store
    finally:
        await store.close()


@pytest.fixture
def streamed(raw: Any, unstreamed: tuple[str, DynamoStore]) -> tuple[str, DynamoStore]:
    enable_stream(raw, unstreamed[0])
    return unstreamed


def reader_for(
    endpoint: str,
    table: str,
    store: DynamoStore,
    handler: Recorder,
    lease: Lease | None = None,
    metrics: Registry | None = None,
) -> TableStreamReader:
    return TableStreamReader(
        store,
        lease if lease is not None else MemoryLease(),
        handler,
        table=table,
        region=TEST_REGION,
        endpoint_url=endpoint,
        poll_seconds=0.05,
        metrics=metrics,
    )


async def checkpoints_of(
    store: DynamoStore, arn: str, within: float, at: Recorder | None = None
) -> dict[str, ShardCheckpoint]:
    """The stream's checkpoints, once there is one (at the last record ``at`` got)."""
    wanted = at.records[-1]["dynamodb"]["SequenceNumber"] if at is not None else None
    deadline = time.monotonic() + within
    while True:
        checkpoints = await store.stream_checkpoints(arn)
        numbers = {c.sequence_number for c in checkpoints.values()}
        if checkpoints and (wanted is None or wanted in numbers):
            return checkpoints
        if time.monotonic() > deadline:
            raise AssertionError(f"no checkpoint at {wanted} after {within:g}s: {checkpoints}")
        await asyncio.sleep(0.05)


async def test_a_first_start_begins_at_the_latest_record(
    dynamodb_endpoint: str, raw: Any, streamed: tuple[str, DynamoStore]
) -> None:
    table, store = streamed
    put_notification(raw, table, "alice", 0)  # a day-old row: not replayed
    recorder = Recorder()
    reader = reader_for(dynamodb_endpoint, table, store, recorder)
    await reader.start()
    try:
        await eventually(
            lambda: bool(reader.positioned), WITHIN_S, "the reader at the latest record"
        )
        put_notification(raw, table, "alice", 1)
        raw.put_item(TableName=table, Item={"pk": {"S": "GAME"}, "sk": {"S": "g1"}})
        await eventually(lambda: len(recorder.records) >= 2, WITHIN_S, "two records")
        # Delivered first, checkpointed after: wait for the checkpoint too.
        arn = raw.describe_table(TableName=table)["Table"]["LatestStreamArn"]
        checkpoints = await checkpoints_of(store, arn, WITHIN_S)
    finally:
        await reader.stop()
    assert recorder.numbers() == [1]
    assert len(checkpoints) == 1 and next(iter(checkpoints.values())).sequence_number


async def test_a_restart_resumes_at_the_checkpoint(
    dynamodb_endpoint: str, raw: Any, streamed: tuple[str, DynamoStore]
) -> None:
    table, store = streamed
    first = Recorder()
    reader = reader_for(dynamodb_endpoint, table, store, first)
    await reader.start()
    await eventually(lambda: bool(reader.positioned), WITHIN_S, "the reader at the latest record")
    for n in range(3):
        put_notification(raw, table, "bob", n)
    await eventually(lambda: len(first.numbers()) == 3, WITHIN_S, "three rows")
    # Delivered first, checkpointed after: stopped before the checkpoint, the next
    # reader would read them again (at least once, by design).
    arn = raw.describe_table(TableName=table)["Table"]["LatestStreamArn"]
    await checkpoints_of(store, arn, WITHIN_S, at=first)
    await reader.stop()
    for n in range(3, 6):  # written while no reader runs
        put_notification(raw, table, "bob", n)
    second = Recorder()
    again = reader_for(dynamodb_endpoint, table, store, second)
    await again.start()
    try:
        await eventually(lambda: len(second.numbers()) >= 3, WITHIN_S, "the rows written meanwhile")
        put_notification(raw, table, "bob", 6)
        await eventually(lambda: len(second.numbers()) >= 4, WITHIN_S, "a live row")
        await asyncio.sleep(0.3)
    finally:
        await again.stop()
    assert first.numbers() == [0, 1, 2]
    assert second.numbers() == [3, 4, 5, 6]  # none skipped, none twice


async def test_one_reader_at_a_time_and_a_handover_skips_nothing(
    dynamodb_endpoint: str, raw: Any, streamed: tuple[str, DynamoStore]
) -> None:
    table, store = streamed
    with redis_url_for_tests() as url:
        leases = [
            RedisLease(make_client(url), "ap:{test-stream}:leader", f"n{i}", 4000) for i in range(2)
        ]
        recorders = [Recorder(), Recorder()]
        readers = [
            reader_for(dynamodb_endpoint, table, store, recorders[i], leases[i]) for i in range(2)
        ]
        for reader in readers:
            await reader.start()
        try:
            await eventually(lambda: any(r.positioned for r in readers), WITHIN_S, "a reader")
            await asyncio.sleep(1.5)
            assert sum(r.reading for r in readers) == 1
            active = 0 if readers[0].reading else 1
            for n in range(3):
                put_notification(raw, table, "carol", n)
            await eventually(lambda: len(recorders[active].numbers()) == 3, WITHIN_S, "three rows")
            arn = raw.describe_table(TableName=table)["Table"]["LatestStreamArn"]
            await checkpoints_of(store, arn, WITHIN_S, at=recorders[active])
            # The active reader dies without a goodbye: its lease lapses. (Killed between
            # publishing and checkpointing, it would leave them to be read again: the
            # notification push's dedup keys catch that, not the reader.)
            lead = readers[active]._lead_task
            assert lead is not None
            lead.cancel()
            await readers[active]._stop_reading("killed")
            for n in range(3, 6):
                put_notification(raw, table, "carol", n)
            other = 1 - active
            await eventually(lambda: len(recorders[other].numbers()) >= 3, WITHIN_S, "the handover")
        finally:
            for reader in readers:
                await reader.stop()
    assert recorders[active].numbers() == [0, 1, 2]
    assert recorders[other].numbers() == [3, 4, 5]


async def test_a_table_without_a_stream_is_named_and_read_once_it_has_one(
    dynamodb_endpoint: str,
    raw: Any,
    unstreamed: tuple[str, DynamoStore],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reader says what to enable, counts each failed start and keeps trying; once
    the table has its stream, it reads it, with no restart of the node."""
    table, store = unstreamed
    recorder, metrics = Recorder(), Registry()
    reader = reader_for(dynamodb_endpoint, table, store, recorder, metrics=metrics)
    await reader.start()
    try:
        await eventually(
            lambda: metrics.value("ap_stream_reader_failures_total") >= 2,
            WITHIN_S,
            "two failed starts",
        )
        assert f"table {table!r} has no stream: enable it (NEW_AND_OLD_IMAGES)" in caplog.text
        assert not reader.reading and not reader.positioned
        enable_stream(raw, table)
        await eventually(lambda: bool(reader.positioned), WITHIN_S, "the reader at work")
        put_notification(raw, table, "alice", 7)
        await eventually(lambda: recorder.numbers() == [7], WITHIN_S, "the notification")
    finally:
        await reader.stop()


async def test_a_stream_of_keys_only_is_named_and_not_read(
    dynamodb_endpoint: str,
    raw: Any,
    unstreamed: tuple[str, DynamoStore],
    caplog: pytest.LogCaptureFixture,
) -> None:
    table, store = unstreamed
    raw.update_table(
        TableName=table,
        StreamSpecification={"StreamEnabled": True, "StreamViewType": "KEYS_ONLY"},
    )
    metrics = Registry()
    reader = reader_for(dynamodb_endpoint, table, store, Recorder(), metrics=metrics)
    await reader.start()
    try:
        await eventually(
            lambda: metrics.value("ap_stream_reader_failures_total") >= 1,
            WITHIN_S,
            "a failed start",
        )
        assert f"the stream of {table!r} is KEYS_ONLY: new images are needed" in caplog.text
        assert not reader.reading and not reader.positioned
    finally:
        await reader.stop()
