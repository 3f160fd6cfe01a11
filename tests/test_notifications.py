"""Notification push end to end: a row put with plain boto3 becomes a live user event.

The table's stream is moto's DynamoDB Streams over HTTP; the node reads it with
``--notifications-from-stream``; clients are real sockets. The handover between
two node processes is in ``tests/cluster/test_notification_push.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from loadtest.harness.faults import TcpFaultProxy
from server.config import Settings
from server.coordination.dedup import Claim, MemoryDedup
from server.coordination.lease import MemoryLease
from server.ingress.notifications import (
    CLAIM_SECONDS,
    DEDUP_PREFIX,
    LEASE_KEY,
    NotificationPush,
    notification_of,
)
from tests.client import Client
from tests.conftest import (
    TEST_REGION,
    RunningServer,
    new_table,
    on_dynamodb,
    run_server,
)
from tests.services import DynamoFaultProxy, RedisServer
from tests.test_table_stream import enable_stream, put_notification
from tests.waiting import eventually


def notifications(client: Client) -> list[dict[str, Any]]:
    return [m for m in client.messages if m.get("verb") == "notification"]


def numbers(client: Client) -> list[int]:
    return [m["payload"]["body"]["n"] for m in notifications(client)]


async def pushed_once_in_order(tab: Client, within: float) -> None:
    """Notifications 1 and 2 reached ``tab``, each once, in order, at offsets 1 and 2."""
    await tab.wait_for(lambda: len(notifications(tab)) >= 2, within=within)
    await tab.barrier()
    assert numbers(tab) == [1, 2]
    assert tab.offsets("user:alice") == [1, 2]


async def reading(running: RunningServer, within: float = 20) -> None:
    """Wait until the node reads the stream (its LATEST iterators taken)."""
    (push,) = [s for s in running.node.services if isinstance(s, NotificationPush)]
    reader = push.reader
    deadline = time.monotonic() + within
    while not reader.positioned:
        assert time.monotonic() < deadline, "the stream reader did not start"
        await asyncio.sleep(0.05)


def settings_for(endpoint: str, table: str, **extra: Any) -> Settings:
    return on_dynamodb(
        endpoint, table, notifications_from_stream=True, **{"stream_poll_ms": 200, **extra}
    )


@pytest.fixture
async def stream_table(dynamodb_endpoint: str, raw: Any) -> str:
    table = await new_table(dynamodb_endpoint)
    enable_stream(raw, table)
    return table


@pytest.fixture
async def pushing(dynamodb_endpoint: str, stream_table: str) -> AsyncIterator[RunningServer]:
    async with run_server(settings_for(dynamodb_endpoint, stream_table)) as running:
        await reading(running)
        yield running


async def test_a_row_put_with_boto3_appears_on_every_open_tab_of_its_user(
    pushing: RunningServer, raw: Any, stream_table: str
) -> None:
    tabs = [await pushing.subscribed("alice") for _ in range(2)]
    speaker = await pushing.subscribed("alice", since={})
    other = await pushing.subscribed("bob")
    sk = put_notification(raw, stream_table, "alice", 7)
    for tab in [*tabs, speaker]:
        frame = await tab.next_message(lambda m: m.get("verb") == "notification", within=10)
        assert frame["payload"] == {"sk": sk, "body": {"type": "gameEnd", "n": 7}}
        assert frame["stream"] == "user:alice" and frame["offset"] == 1
    await other.barrier()
    assert notifications(other) == []


async def test_other_records_are_not_pushed(
    pushing: RunningServer, raw: Any, stream_table: str
) -> None:
    tab = await pushing.subscribed("alice")
    sk = put_notification(raw, stream_table, "alice", 1)
    await tab.next_message(lambda m: m.get("verb") == "notification", within=10)
    # Marked seen (a MODIFY), dismissed (a REMOVE), and other kinds of rows.
    key = {"pk": {"S": "NOTIFICATION#alice"}, "sk": {"S": sk}}
    raw.update_item(
        TableName=stream_table,
        Key=key,
        UpdateExpression="SET expiresAt = :e",
        ExpressionAttributeValues={":e": {"N": "1"}},
    )
    raw.delete_item(TableName=stream_table, Key=key)
    raw.put_item(TableName=stream_table, Item={"pk": {"S": "GAME"}, "sk": {"S": "chess#0#g1"}})
    raw.put_item(TableName=stream_table, Item={"pk": {"S": "USERS"}, "sk": {"S": "alice"}})
    put_notification(raw, stream_table, "alice", 2)
    await tab.wait_for(lambda: len(notifications(tab)) >= 2, within=10)
    await asyncio.sleep(0.5)
    assert numbers(tab) == [1, 2]


def record_of(sk: str, event_id: str) -> dict[str, Any]:
    """The stream record of alice's notification ``sk`` (number 1), as a reader gets it."""
    return {
        "eventID": event_id,
        "eventName": "INSERT",
        "dynamodb": {
            "Keys": {"pk": {"S": "NOTIFICATION#alice"}, "sk": {"S": sk}},
            "NewImage": {"body": {"M": {"type": {"S": "gameEnd"}, "n": {"N": "1"}}}},
        },
    }


def another_reader(running: RunningServer, table: str, dedup: MemoryDedup) -> NotificationPush:
    """A second push on the node's bus: the reader that takes over after a handover."""
    return NotificationPush(
        running.node.publish,
        running.node.store,
        MemoryLease(),
        dedup,
        node_id=running.node.node_id,
        table=table,
        region=TEST_REGION,
        endpoint_url=None,
        poll_seconds=1.0,
        metrics=running.node.metrics,
    )


async def test_a_record_published_again_with_no_dedup_trace_is_pushed_once(
    pushing: RunningServer, raw: Any, stream_table: str
) -> None:
    """A reader killed between publishing and marking done leaves only a claim that
    expires; the next reader (here: one whose dedup store knows nothing) publishes the
    record again. The append is named by the row's sk, so the user hears it once."""
    tab = await pushing.subscribed("alice", since={})
    sk = put_notification(raw, stream_table, "alice", 1)
    await tab.next_message(lambda m: m.get("verb") == "notification", within=10)
    next_reader = another_reader(pushing, stream_table, MemoryDedup())
    assert await next_reader.handle([record_of(sk, "the-record-again")]) == 1
    put_notification(raw, stream_table, "alice", 2)
    await pushed_once_in_order(tab, within=10)


async def test_a_record_claimed_by_a_killed_reader_is_pushed_at_once_and_once(
    pushing: RunningServer, raw: Any, stream_table: str
) -> None:
    """A reader killed between publishing and marking done leaves its claim for
    CLAIM_SECONDS. The next reader publishes the record at once rather than hold the
    shard back that long; the named append makes the user hear it once."""
    tab = await pushing.subscribed("alice", since={})
    sk = put_notification(raw, stream_table, "alice", 1)
    await tab.next_message(lambda m: m.get("verb") == "notification", within=10)
    dedup = MemoryDedup()
    key = DEDUP_PREFIX + "the-claimed-record"
    assert await dedup.claim([key], "the-killed-reader", CLAIM_SECONDS) == [Claim.CLAIMED]
    next_reader = another_reader(pushing, stream_table, dedup)
    assert await next_reader.handle([record_of(sk, "the-claimed-record")]) == 1
    assert pushing.node.metrics.value("ap_notifications_taken_over_total") == 1
    # Done now: a third reading is not published again.
    assert await dedup.claim([key], "a-later-reader", CLAIM_SECONDS) == [Claim.DONE]
    put_notification(raw, stream_table, "alice", 2)
    await pushed_once_in_order(tab, within=10)


def test_only_inserts_of_notification_rows_become_notifications() -> None:
    def record(event: str, pk: str, image: dict[str, Any] | None) -> dict[str, Any]:
        change: dict[str, Any] = {"Keys": {"pk": {"S": pk}, "sk": {"S": "1#a"}}}
        if image is not None:
            change["NewImage"] = image
        return {"eventID": "e1", "eventName": event, "dynamodb": change}

    body = {"body": {"M": {"type": {"S": "ratingChange"}, "delta": {"N": "-12.5"}}}}
    found = notification_of(record("INSERT", "NOTIFICATION#u1", body))
    assert found is not None
    assert (found.user_id, found.sk, found.body) == (
        "u1",
        "1#a",
        {"type": "ratingChange", "delta": -12.5},
    )
    assert notification_of(record("MODIFY", "NOTIFICATION#u1", body)) is None
    assert notification_of(record("INSERT", "GAME", body)) is None
    assert notification_of(record("INSERT", "NOTIFICATION#u1", {})) is None


async def test_after_a_restart_the_checkpoint_resumes_where_it_stopped(
    dynamodb_endpoint: str, raw: Any, stream_table: str, fresh_redis: RedisServer
) -> None:
    """Redis keeps the user stream's history, so a client that was away recovers exactly."""
    redis_url = fresh_redis.url  # nodes: the worker's own Redis (fixed channels)
    settings = settings_for(dynamodb_endpoint, stream_table, redis_url=redis_url)
    async with run_server(settings) as running:
        await reading(running)
        tab = await running.subscribed("alice", since={})
        for n in (1, 2):
            put_notification(raw, stream_table, "alice", n)
        await tab.wait_for(lambda: len(notifications(tab)) == 2, within=10)
        last = notifications(tab)[-1]
    for n in (3, 4):  # while no node reads the stream
        put_notification(raw, stream_table, "alice", n)
    async with run_server(settings) as running:
        since = {"user:alice": {"epoch": last["epoch"], "offset": last["offset"]}}
        deadline = time.monotonic() + 15
        while True:  # the reader resumes on its own; poll with recovery until both are in
            again = await running.subscribed("alice", since=since)
            answer = await again.wait_recovered("user:alice")
            if answer["offset"] >= last["offset"] + 2 or time.monotonic() > deadline:
                break
            await again.close()
            await asyncio.sleep(0.3)
        assert answer["recovered"] is True
        assert numbers(again) == [3, 4]  # none skipped, none pushed twice
        put_notification(raw, stream_table, "alice", 5)
        await again.wait_for(lambda: len(notifications(again)) == 3, within=10)
        await asyncio.sleep(0.5)
        assert numbers(again) == [3, 4, 5]
        assert [m["offset"] for m in notifications(again)] == [3, 4, 5]


async def test_a_failed_checkpoint_and_a_failed_listing_lose_and_repeat_nothing(
    dynamodb_proxy: DynamoFaultProxy, raw: Any, stream_table: str
) -> None:
    """DynamoDB refuses the checkpoint written after a record was pushed, then the
    shard listing of the next round: the reader starts its term again and reads the
    shard from before that record. The record is read twice and pushed once."""
    proxy = dynamodb_proxy
    async with run_server(settings_for(proxy.endpoint, stream_table)) as running:
        await reading(running)
        tab = await running.subscribed("alice", since={})
        # Errors the clients do not retry, so the reader sees them.
        proxy.fail_operation("PutItem", 1, "ValidationException", 400)
        proxy.fail_operation("DescribeStream", 1, "ValidationException", 400)
        put_notification(raw, stream_table, "alice", 1)
        await tab.next_message(lambda m: m.get("verb") == "notification", within=10)
        metrics = running.node.metrics
        await eventually(
            lambda: metrics.value("ap_notifications_repeated_total") >= 1,
            30,
            "the record read again after the new term",
        )
        assert proxy.injected == {"ValidationException": 2}
        # One for the shard whose checkpoint failed, one for the term's listing.
        assert metrics.value("ap_stream_reader_failures_total") >= 2
        put_notification(raw, stream_table, "alice", 2)
        await pushed_once_in_order(tab, within=10)


async def test_a_batch_whose_claims_redis_refuses_is_handed_on_again_and_pushed_once(
    dynamodb_endpoint: str, raw: Any, stream_table: str, redis_proxy: TcpFaultProxy
) -> None:
    """Redis never sees the batch's dedup claims (their connection is reset, and so
    is redis-py's one retry): the reader keeps its place in the shard and hands the
    same batch on again until it is taken, so nothing is skipped or pushed twice."""
    settings = settings_for(dynamodb_endpoint, stream_table, redis_url=redis_proxy.url)
    async with run_server(settings) as running:
        await reading(running)
        tab = await running.subscribed("alice", since={})
        redis_proxy.cut_before(DEDUP_PREFIX.encode(), 2)
        for n in (1, 2):
            put_notification(raw, stream_table, "alice", n)
        await pushed_once_in_order(tab, within=20)
        metrics = running.node.metrics
        assert redis_proxy.cuts_before_write == 2
        assert metrics.value("ap_stream_reader_failures_total") >= 1
        assert metrics.value("ap_notifications_pushed_total") == 2
        assert metrics.value("ap_notifications_repeated_total") == 0


async def test_an_expired_shard_iterator_is_taken_again_after_the_last_record_read(
    dynamodb_proxy: DynamoFaultProxy, raw: Any, stream_table: str
) -> None:
    """Shard iterators expire after 15 minutes: the reader takes a new one after
    the last record it read, not at the shard's latest, so a row written
    meanwhile still arrives, once."""
    proxy = dynamodb_proxy
    settings = settings_for(proxy.endpoint, stream_table, stream_poll_ms=3000)
    async with run_server(settings) as running:
        await reading(running)
        tab = await running.subscribed("alice", since={})
        put_notification(raw, stream_table, "alice", 1)
        await tab.next_message(lambda m: m.get("verb") == "notification", within=10)
        # The read after the one that brought it finds nothing, and the reader
        # pauses: the row below is written before the shard is read again.
        polled = proxy.count("GetRecords")
        await eventually(lambda: proxy.count("GetRecords") > polled, 10, "the next read")
        proxy.fail_operation("GetRecords", 1, "ExpiredIteratorException", 400)
        put_notification(raw, stream_table, "alice", 2)
        await pushed_once_in_order(tab, within=20)
        assert proxy.injected == {"ExpiredIteratorException": 1}
        assert running.node.metrics.value("ap_stream_reader_failures_total") == 0


async def test_a_reader_that_cannot_renew_its_lease_stops_then_resumes_where_it_was(
    dynamodb_endpoint: str, raw: Any, stream_table: str, redis_proxy: TcpFaultProxy
) -> None:
    """Redis never sees the stream lease's renewals for longer than a lease term:
    the reader stops reading when its term runs out (another node may hold the
    lease by then) and pushes nothing meanwhile. When a renewal gets through it
    starts a new term from its checkpoint: the row written while it was stopped
    arrives, once."""
    # Heartbeats every second: a lease term of 3 s (``lease_ms_for``).
    settings = settings_for(
        dynamodb_endpoint, stream_table, redis_url=redis_proxy.url, node_heartbeat_ms=1000
    )
    async with run_server(settings) as running:
        await reading(running)
        (push,) = [s for s in running.node.services if isinstance(s, NotificationPush)]
        tab = await running.subscribed("alice", since={})
        put_notification(raw, stream_table, "alice", 1)
        await tab.next_message(lambda m: m.get("verb") == "notification", within=10)
        # Each renewal is tried twice (redis-py's retry), once a second: about
        # 7 s without one, against a term of 3 s.
        redis_proxy.cut_before(LEASE_KEY.encode(), 14)
        await eventually(lambda: not push.reader.reading, 20, "the reader stopped")
        put_notification(raw, stream_table, "alice", 2)
        await asyncio.sleep(1.0)
        assert numbers(tab) == [1]  # not pushed without the lease
        await pushed_once_in_order(tab, within=30)
        assert redis_proxy.cuts_before_write == 14
        assert push.reader.reading


async def test_a_row_no_client_could_decode_is_counted_and_the_next_one_still_arrives(
    pushing: RunningServer, raw: Any, stream_table: str
) -> None:
    """A number DynamoDB holds (38 digits) but msgpack cannot (over 64 bits): retrying
    cannot fix it, so it is counted and skipped like a poison message, not retried
    forever in front of every later notification."""
    tab = await pushing.subscribed("alice", since={})
    put_notification(raw, stream_table, "alice", 2**70)
    put_notification(raw, stream_table, "alice", 2)
    await tab.next_message(lambda m: m.get("verb") == "notification", within=10)
    await tab.barrier()
    assert numbers(tab) == [2]
    assert tab.offsets("user:alice") == [1]
    metrics = pushing.node.metrics
    assert metrics.value("ap_notifications_unpushable_total") == 1
    assert metrics.value("ap_stream_reader_failures_total") == 0
