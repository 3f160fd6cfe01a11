"""DynamoStore against a real DynamoDB endpoint (moto over HTTP).

Rows written through the store are read back with plain boto3, so the on-disk
shape (attribute names and DynamoDB types) is checked independently of the
store's own decoding. Throttling and unprocessed items, which moto never
produces, come from ``DynamoFaultProxy``: a real HTTP proxy in front of moto.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from server.store import ConnectionRecord, StoreUnavailable, keys, ttl_from_now
from server.store.dynamodb import (
    KEY_ATTRIBUTES,
    KEY_SCHEMA,
    START_ATTEMPTS,
    DynamoStore,
    create_table,
)
from server.store.records import LAST_SEEN_INTERVAL_MS
from tests.services import DynamoFaultProxy, ensure_fake_aws_credentials

REGION = "us-east-1"


@pytest.fixture
def endpoint(dynamodb_endpoint: str) -> str:
    return dynamodb_endpoint


@pytest.fixture
async def store(endpoint: str, table: str) -> AsyncIterator[DynamoStore]:
    impl = DynamoStore(table=table, region=REGION, endpoint_url=endpoint)
    await impl.start()
    try:
        yield impl
    finally:
        await impl.close()


def connection_row(raw: Any, table: str, connection_id: str) -> dict[str, Any] | None:
    response = raw.get_item(
        TableName=table,
        Key={"pk": {"S": "wsConnections"}, "sk": {"S": connection_id}},
        ConsistentRead=True,
    )
    item: dict[str, Any] | None = response.get("Item")
    return item


def sample(connection_id: str = "conn-1", **changes: Any) -> ConnectionRecord:
    fields: dict[str, Any] = {
        "connection_id": connection_id,
        "user_id": "user-1",
        "invisible": True,
        "endpoint": "http://10.0.0.7:8080",
        "wants_presence": False,
        "watch_version": 1,
        "watching_games": frozenset({"chess#123", "go#9"}),
        "ttl": 1_900_000_000,
    }
    fields.update(changes)
    return ConnectionRecord(**fields)


# ----------------------------------------------------------------- row shape


async def test_connection_row_has_every_attribute_with_its_type(
    store: DynamoStore, raw: Any, table: str
) -> None:
    await store.write_connections([sample()], [])
    assert connection_row(raw, table, "conn-1") == {
        "pk": {"S": "wsConnections"},
        "sk": {"S": "conn-1"},
        "connectionId": {"S": "conn-1"},
        "userId": {"S": "user-1"},
        "invisible": {"BOOL": True},
        "endpoint": {"S": "http://10.0.0.7:8080"},
        "wantsPresence": {"BOOL": False},
        "watchVersion": {"N": "1"},
        "watchingGames": {"SS": ["chess#123", "go#9"]},
        "ttl": {"N": "1900000000"},
    }


async def test_empty_games_and_no_watch_version_are_absent(
    store: DynamoStore, raw: Any, table: str
) -> None:
    await store.write_connections(
        [sample(watching_games=frozenset(), watch_version=None, invisible=False)], []
    )
    row = connection_row(raw, table, "conn-1")
    assert row is not None
    assert "watchingGames" not in row
    assert "watchVersion" not in row
    assert row["invisible"] == {"BOOL": False}
    assert row["wantsPresence"] == {"BOOL": False}
    assert set(row["ttl"]) == {"N"} and row["ttl"]["N"] == str(int(row["ttl"]["N"]))


async def test_update_watch_writes_ss_and_removes_it_when_empty(
    store: DynamoStore, raw: Any, table: str
) -> None:
    await store.write_connections([sample(watch_version=None, watching_games=frozenset())], [])
    await store.update_watch("conn-1", frozenset({"a#1", "b#2"}), 1, 1_900_000_500)
    row = connection_row(raw, table, "conn-1")
    assert row is not None
    assert set(row["watchingGames"]) == {"SS"}
    assert sorted(row["watchingGames"]["SS"]) == ["a#1", "b#2"]
    assert row["watchVersion"] == {"N": "1"}
    assert row["ttl"] == {"N": "1900000500"}

    await store.update_watch("conn-1", frozenset(), 1, 1_900_000_600)
    row = connection_row(raw, table, "conn-1")
    assert row is not None
    assert "watchingGames" not in row
    assert row["ttl"] == {"N": "1900000600"}
    assert row["userId"] == {"S": "user-1"}  # untouched


async def test_refresh_ttl_sets_only_ttl(store: DynamoStore, raw: Any, table: str) -> None:
    await store.write_connections([sample()], [])
    before = connection_row(raw, table, "conn-1")
    await store.refresh_ttl("conn-1", 1_950_000_000)
    after = connection_row(raw, table, "conn-1")
    assert before is not None and after is not None
    assert after["ttl"] == {"N": "1950000000"}
    assert {k: v for k, v in after.items() if k != "ttl"} == {
        k: v for k, v in before.items() if k != "ttl"
    }


async def test_updates_of_missing_rows_write_nothing(
    store: DynamoStore, raw: Any, table: str
) -> None:
    await store.update_watch("ghost", frozenset({"a#1"}), 1, ttl_from_now())
    await store.refresh_ttl("ghost", ttl_from_now())
    assert connection_row(raw, table, "ghost") is None
    assert raw.scan(TableName=table)["Count"] == 0


async def test_presence_seq_row_is_a_number(store: DynamoStore, raw: Any, table: str) -> None:
    assert await store.reserve_presence_seq(1) == 1
    assert await store.reserve_presence_seq(2) == 2
    row = raw.get_item(
        TableName=table,
        Key={"pk": {"S": "wsMeta"}, "sk": {"S": "presenceSeq"}},
        ConsistentRead=True,
    )["Item"]
    assert row == {"pk": {"S": "wsMeta"}, "sk": {"S": "presenceSeq"}, "seq": {"N": "2"}}


async def test_reads_rows_written_by_todays_lambdas(
    store: DynamoStore, raw: Any, table: str
) -> None:
    # Today's subscribe Lambda may leave out wantsPresence and watchVersion.
    raw.put_item(
        TableName=table,
        Item={
            "pk": {"S": "wsConnections"},
            "sk": {"S": "legacy"},
            "connectionId": {"S": "legacy"},
            "userId": {"S": "user-5"},
            "invisible": {"BOOL": False},
            "endpoint": {"S": "abc.execute-api.us-east-1.amazonaws.com/prod"},
            "ttl": {"N": str(ttl_from_now())},
        },
    )
    record = await store.get_connection("legacy")
    assert record is not None
    assert record.wants_presence is True
    assert record.watch_version is None
    assert record.watching_games == frozenset()
    assert record.user_id == "user-5"


async def test_malformed_rows_are_skipped_by_list(store: DynamoStore, raw: Any, table: str) -> None:
    raw.put_item(
        TableName=table,
        Item={"pk": {"S": "wsConnections"}, "sk": {"S": "junk"}, "ttl": {"N": "1900000000"}},
    )
    await store.write_connections([sample("good")], [])
    assert [r.connection_id for r in await store.list_connections()] == ["good"]
    assert await store.get_connection("junk") is None


async def test_delete_endpoint_connections_removes_rows_physically(
    store: DynamoStore, raw: Any, table: str
) -> None:
    past = int(time.time()) - 100
    await store.write_connections(
        [sample("a", endpoint="node-a"), sample("b", endpoint="node-a", ttl=past)], []
    )
    await store.write_connections([sample("c", endpoint="node-c")], [])
    assert await store.delete_endpoint_connections("node-a") == 2
    remaining = raw.scan(TableName=table)["Items"]
    assert [item["sk"]["S"] for item in remaining] == ["c"]


def test_keys_round_trip_a_record() -> None:
    record = sample(watching_games=frozenset(), watch_version=None)
    item = keys.to_item(record)
    assert "watchingGames" not in item and "watchVersion" not in item
    assert keys.from_item(item) == record
    with pytest.raises(ValueError):
        keys.string_set(frozenset())


# --------------------------------------------------------------- table setup


async def test_create_table_enables_ttl_and_is_idempotent(endpoint: str, raw: Any) -> None:
    name = f"setup-{uuid.uuid4().hex[:12]}"
    await create_table(endpoint, name, REGION)
    await create_table(endpoint, name, REGION)  # existing table: fine
    ttl = raw.describe_time_to_live(TableName=name)["TimeToLiveDescription"]
    assert ttl["TimeToLiveStatus"] == "ENABLED"
    assert ttl["AttributeName"] == "ttl"
    description = raw.describe_table(TableName=name)["Table"]
    assert description["TableStatus"] == "ACTIVE"
    assert {k["AttributeName"]: k["KeyType"] for k in description["KeySchema"]} == {
        "pk": "HASH",
        "sk": "RANGE",
    }
    assert {
        a["AttributeName"]: a["AttributeType"] for a in description["AttributeDefinitions"]
    } == {
        "pk": "S",
        "sk": "S",
    }
    assert description["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"


async def test_create_table_enables_ttl_on_an_existing_table_without_it(
    endpoint: str, raw: Any
) -> None:
    name = f"bare-{uuid.uuid4().hex[:12]}"
    raw.create_table(
        TableName=name,
        AttributeDefinitions=KEY_ATTRIBUTES,
        KeySchema=KEY_SCHEMA,
        BillingMode="PAY_PER_REQUEST",
    )
    assert (
        raw.describe_time_to_live(TableName=name)["TimeToLiveDescription"]["TimeToLiveStatus"]
        == "DISABLED"
    )
    await create_table(endpoint, name, REGION)
    ttl = raw.describe_time_to_live(TableName=name)["TimeToLiveDescription"]
    assert (ttl["TimeToLiveStatus"], ttl["AttributeName"]) == ("ENABLED", "ttl")


async def test_a_table_whose_ttl_is_on_another_attribute_is_refused_and_left_alone(
    endpoint: str, raw: Any
) -> None:
    """DynamoDB has one TTL attribute per table: with it on another one, connection rows
    would never expire. Say so, rather than take the table over."""
    name = f"ttl-{uuid.uuid4().hex[:12]}"
    raw.create_table(
        TableName=name,
        AttributeDefinitions=KEY_ATTRIBUTES,
        KeySchema=KEY_SCHEMA,
        BillingMode="PAY_PER_REQUEST",
    )
    raw.update_time_to_live(
        TableName=name, TimeToLiveSpecification={"Enabled": True, "AttributeName": "expiresAt"}
    )
    with pytest.raises(
        StoreUnavailable, match="has TTL on 'expiresAt', not 'ttl'; connection rows would never"
    ):
        await create_table(endpoint, name, REGION)
    ttl = raw.describe_time_to_live(TableName=name)["TimeToLiveDescription"]
    assert (ttl["TimeToLiveStatus"], ttl["AttributeName"]) == ("ENABLED", "expiresAt")


# ---------------------------------------------------------------- start/close


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # closed again: nothing listens there


async def test_start_against_unreachable_endpoint_fails_fast_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ensure_fake_aws_credentials()  # else botocore fails first, for want of them
    url = f"http://127.0.0.1:{closed_port()}"
    store = DynamoStore(table="anything", region=REGION, endpoint_url=url)
    with pytest.raises(StoreUnavailable) as caught:
        await store.start()
    # Fast by count, whatever the machine's load: START_ATTEMPTS refused connects
    # (no timeout waited out), one short backoff between them.
    message = str(caught.value)
    assert f"failed after {START_ATTEMPTS} attempts" in message
    assert "Could not connect" in message
    retries = [r for r in caplog.records if "describe_table" in r.getMessage()]
    assert len(retries) == START_ATTEMPTS - 1
    assert url in message
    assert "'anything'" in message
    await store.close()


async def test_start_with_missing_table_names_it(endpoint: str) -> None:
    store = DynamoStore(table="no-such-table", region=REGION, endpoint_url=endpoint)
    with pytest.raises(StoreUnavailable) as caught:
        await store.start()
    assert "no-such-table" in str(caught.value)
    assert "does not exist" in str(caught.value)
    assert endpoint in str(caught.value)


async def test_start_rejects_a_table_with_another_key_schema(endpoint: str, raw: Any) -> None:
    name = f"wrong-{uuid.uuid4().hex[:12]}"
    raw.create_table(
        TableName=name,
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
        KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        BillingMode="PAY_PER_REQUEST",
    )
    store = DynamoStore(table=name, region=REGION, endpoint_url=endpoint)
    with pytest.raises(StoreUnavailable, match="key schema"):
        await store.start()


async def test_use_before_start_raises_store_unavailable() -> None:
    store = DynamoStore(table="t", region=REGION, endpoint_url="http://127.0.0.1:9")
    with pytest.raises(StoreUnavailable):
        await store.get_connection("x")


# ------------------------------------------------- throttling and retries


@pytest.fixture
async def proxied(dynamodb_proxy: DynamoFaultProxy, table: str) -> AsyncIterator[DynamoStore]:
    impl = DynamoStore(
        table=table, region=REGION, endpoint_url=dynamodb_proxy.endpoint, max_attempts=4
    )
    await impl.start()
    try:
        yield impl
    finally:
        await impl.close()


def metric(store: DynamoStore, name: str) -> float:
    return store.metrics.value(name)


async def test_throttled_requests_are_retried_and_counted(
    proxied: DynamoStore, dynamodb_proxy: DynamoFaultProxy
) -> None:
    throttles, retries = (
        metric(proxied, "ap_dynamodb_throttles_total"),
        metric(proxied, "ap_dynamodb_retries_total"),
    )
    dynamodb_proxy.fail_next(2, "ProvisionedThroughputExceededException")
    await proxied.write_connections([sample("t1")], [])
    assert dynamodb_proxy.count("BatchWriteItem") == 3
    assert metric(proxied, "ap_dynamodb_throttles_total") == throttles + 2
    assert metric(proxied, "ap_dynamodb_retries_total") == retries + 2
    assert await proxied.get_connection("t1") == sample("t1")


async def test_server_errors_are_retried(
    proxied: DynamoStore, dynamodb_proxy: DynamoFaultProxy
) -> None:
    dynamodb_proxy.fail_next(1, "InternalServerError", status=500)
    assert await proxied.reserve_presence_seq(1) == 1
    dynamodb_proxy.fail_next(1, "ThrottlingException")
    assert await proxied.reserve_presence_seq(2) == 2
    assert dynamodb_proxy.count("UpdateItem") == 4


async def test_a_reserve_retried_after_its_answer_was_lost_does_not_skip(
    proxied: DynamoStore, dynamodb_proxy: DynamoFaultProxy
) -> None:
    """The write applies, its answer never comes back, the store retries: the
    seq is where the first attempt put it (``ADD seq 1`` made it 2)."""
    assert await proxied.reserve_presence_seq(1) == 1
    dynamodb_proxy.drop_response("UpdateItem")
    assert await proxied.reserve_presence_seq(2) == 2
    assert dynamodb_proxy.injected.get("dropped") == 1 and dynamodb_proxy.count("UpdateItem") >= 3
    assert await proxied.current_presence_seq() == 2
    assert await proxied.reserve_presence_seq(3) == 3


async def test_persistent_throttling_gives_up_with_store_unavailable(
    proxied: DynamoStore, dynamodb_proxy: DynamoFaultProxy
) -> None:
    failures = metric(proxied, "ap_dynamodb_failures_total")
    dynamodb_proxy.fail_next(10, "ThrottlingException")
    with pytest.raises(StoreUnavailable, match="ThrottlingException") as caught:
        await proxied.get_connection("x")
    assert "4 attempts" in str(caught.value)
    assert dynamodb_proxy.count("GetItem") == 4
    assert metric(proxied, "ap_dynamodb_failures_total") == failures + 1


async def test_validation_errors_are_not_retried(
    proxied: DynamoStore, dynamodb_proxy: DynamoFaultProxy
) -> None:
    dynamodb_proxy.fail_next(1, "ValidationException")
    with pytest.raises(StoreUnavailable, match="ValidationException"):
        await proxied.refresh_ttl("x", 1)
    assert dynamodb_proxy.count("UpdateItem") == 1


async def test_unprocessed_items_are_written_again_until_none_are_left(
    proxied: DynamoStore, dynamodb_proxy: DynamoFaultProxy, raw: Any, table: str
) -> None:
    unprocessed = metric(proxied, "ap_dynamodb_unprocessed_items_total")
    dynamodb_proxy.unprocessed_rounds = 6
    rows = [sample(f"u-{i:02d}") for i in range(60)]
    await proxied.write_connections(rows, [])
    assert dynamodb_proxy.unprocessed_rounds == 0  # the proxy really held items back
    assert dynamodb_proxy.count("BatchWriteItem") > 3
    assert metric(proxied, "ap_dynamodb_unprocessed_items_total") > unprocessed
    assert raw.scan(TableName=table, Select="COUNT")["Count"] == 60
    assert {r.connection_id for r in await proxied.list_connections()} == {
        r.connection_id for r in rows
    }


async def test_batch_writes_are_chunked_to_25_items(
    proxied: DynamoStore, dynamodb_proxy: DynamoFaultProxy
) -> None:
    await proxied.write_connections([sample(f"p-{i:02d}") for i in range(60)], [])
    assert sorted(dynamodb_proxy.batch_sizes) == [10, 25, 25]
    dynamodb_proxy.batch_sizes.clear()
    assert await proxied.delete_endpoint_connections("http://10.0.0.7:8080") == 60
    assert sorted(dynamodb_proxy.batch_sizes) == [10, 25, 25]
    assert await proxied.list_connections() == []


# ------------------------------------------- lastSeen: 25 updates a BatchExecuteStatement


def seed_users(raw: Any, table: str, users: dict[str, int | None]) -> None:
    """USERS rows, with ``lastSeen`` where the value is not None."""
    for user, last in users.items():
        item = {"pk": {"S": "USERS"}, "sk": {"S": user}, "name": {"S": user.title()}}
        if last is not None:
            item["lastSeen"] = {"N": str(last)}
        raw.put_item(TableName=table, Item=item)


def last_seen(raw: Any, table: str, user: str) -> int | None:
    item = raw.get_item(
        TableName=table, Key={"pk": {"S": "USERS"}, "sk": {"S": user}}, ConsistentRead=True
    )["Item"]
    assert item["name"] == {"S": user.title()}  # the rest of the row is untouched
    return int(item["lastSeen"]["N"]) if "lastSeen" in item else None


NOW = 10 * LAST_SEEN_INTERVAL_MS
STALE = NOW - LAST_SEEN_INTERVAL_MS - 1


async def test_stale_last_seen_goes_25_to_a_statement_batch_and_a_first_one_alone(
    proxied: DynamoStore, dynamodb_proxy: DynamoFaultProxy, raw: Any, table: str
) -> None:
    users: dict[str, int | None] = {f"s{i:02d}": STALE for i in range(60)}
    users["first-visit"] = None  # no lastSeen yet: no equality can say "still missing"
    seed_users(raw, table, users)
    assert await proxied.touch_last_seen_many(dict.fromkeys(users, NOW)) == set(users)
    assert dynamodb_proxy.count("BatchExecuteStatement") == 3  # 25, 25 and 10
    assert dynamodb_proxy.count("UpdateItem") == 1
    assert {user: last_seen(raw, table, user) for user in users} == dict.fromkeys(users, NOW)


async def test_statements_dynamodb_throttles_are_sent_again_and_a_failed_condition_is_left(
    proxied: DynamoStore, dynamodb_proxy: DynamoFaultProxy, raw: Any, table: str
) -> None:
    seed_users(raw, table, {"ann": STALE, "bob": STALE, "cy": STALE})
    dynamodb_proxy.fail_statements(["ThrottlingError", "ConditionalCheckFailed"])
    written = await proxied.touch_last_seen_many({"ann": NOW, "bob": NOW, "cy": NOW})
    assert written == {"ann", "cy"}  # bob's row was written meanwhile, as far as we know
    assert dynamodb_proxy.count("BatchExecuteStatement") == 2  # ann's statement again
    assert [last_seen(raw, table, u) for u in ("ann", "bob", "cy")] == [NOW, STALE, NOW]


async def test_a_statement_refused_for_another_reason_is_store_unavailable(
    proxied: DynamoStore, dynamodb_proxy: DynamoFaultProxy, raw: Any, table: str
) -> None:
    seed_users(raw, table, {"ann": STALE, "bob": STALE})
    dynamodb_proxy.fail_statements([None, "ValidationError"])
    with pytest.raises(StoreUnavailable, match=r"'bob'.*ValidationError"):
        await proxied.touch_last_seen_many({"ann": NOW, "bob": NOW})
    assert dynamodb_proxy.count("BatchExecuteStatement") == 1
    assert last_seen(raw, table, "bob") == STALE


async def test_a_last_seen_written_since_it_was_read_is_left_alone(
    store: DynamoStore, raw: Any, table: str
) -> None:
    # The race the condition is for (another node, or the backend, wrote the row
    # between the store's read and its update); moto evaluates this equality.
    seed_users(raw, table, {"ann": STALE + 5})
    read_before = {"N": str(STALE)}
    await store._touch_still_as_read([("ann", read_before)], {"ann": NOW})
    assert last_seen(raw, table, "ann") == STALE + 5
