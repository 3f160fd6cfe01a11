"""A node on DynamoDB (moto over HTTP): rows as the backend reads them, ownership, outages."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from server.store.base import ConnectionRecord
from server.store.dynamodb import DynamoStore
from tests.client import Client
from tests.conftest import RunningServer, on_dynamodb, run_server
from tests.services import DynamoFaultProxy, free_port
from tests.waiting import eventually

REGION = "us-east-1"


@pytest.fixture
async def dynamo_server(dynamodb_endpoint: str, table: str) -> AsyncIterator[RunningServer]:
    async with run_server(on_dynamodb(dynamodb_endpoint, table)) as running:
        yield running


def connection_items(raw: Any, table: str) -> list[dict[str, Any]]:
    response = raw.query(
        TableName=table,
        KeyConditionExpression="pk = :pk",
        ExpressionAttributeValues={":pk": {"S": "wsConnections"}},
        ConsistentRead=True,
    )
    items: list[dict[str, Any]] = response["Items"]
    return items


async def test_rows_match_the_schema_through_the_whole_lifecycle(
    dynamo_server: RunningServer, raw: Any, table: str
) -> None:
    alice = await dynamo_server.subscribed("alice", games=[("chess", "g1"), ("go", "g2")])
    await dynamo_server.node.registry.drained()
    [item] = connection_items(raw, table)
    assert set(item) == {
        "pk",
        "sk",
        "connectionId",
        "userId",
        "invisible",
        "endpoint",
        "wantsPresence",
        "watchVersion",
        "watchingGames",
        "ttl",
    }
    assert item["pk"] == {"S": "wsConnections"}
    assert item["sk"] == item["connectionId"]
    assert item["userId"] == {"S": "alice"}
    assert item["invisible"] == {"BOOL": False}
    assert item["wantsPresence"] == {"BOOL": True}
    assert item["endpoint"] == {"S": "test-node"}
    assert item["watchVersion"] == {"N": "1"}
    assert sorted(item["watchingGames"]["SS"]) == ["chess#g1", "go#g2"]
    assert abs(int(item["ttl"]["N"]) - (time.time() + 86_400)) < 60

    await alice.watch([])
    await alice.barrier()
    await dynamo_server.node.registry.drained()
    [item] = connection_items(raw, table)
    assert "watchingGames" not in item  # DynamoDB has no empty sets
    assert item["watchVersion"] == {"N": "1"}

    await alice.wait_for(lambda: alice.presence.visible == {"alice"})
    meta = raw.get_item(
        TableName=table,
        Key={"pk": {"S": "wsMeta"}, "sk": {"S": "presenceSeq"}},
        ConsistentRead=True,
    )["Item"]
    # Written before each commit, so never behind a seq a client saw; the writer may
    # already have reserved the next one when a change window opened.
    assert alice.presence.seq is not None
    assert alice.presence.seq <= int(meta["seq"]["N"]) <= alice.presence.seq + 1

    await alice.close()
    await eventually(lambda: connection_items(raw, table) == [], 30, "the rows deleted")


async def test_a_legacy_invisible_row_has_no_watch_attributes(
    dynamo_server: RunningServer, raw: Any, table: str
) -> None:
    await dynamo_server.subscribed("bob", invisible=True, watch_version=None, wants_presence=False)
    await dynamo_server.node.registry.drained()
    [item] = connection_items(raw, table)
    assert "watchVersion" not in item and "watchingGames" not in item
    assert item["invisible"] == {"BOOL": True}
    assert item["wantsPresence"] == {"BOOL": False}


async def test_a_node_deletes_its_earlier_rows_on_start_and_its_rows_on_shutdown(
    dynamodb_endpoint: str, table: str, raw: Any
) -> None:
    store = DynamoStore(table=table, region=REGION, endpoint_url=dynamodb_endpoint)
    await store.start()
    left_behind = [
        ConnectionRecord(f"old{i}", "ghost", False, "test-node", True, 1, frozenset(), 2**31)
        for i in range(30)
    ]
    other_node = ConnectionRecord("x1", "carol", False, "other-node", True, 1, frozenset(), 2**31)
    await store.write_connections([*left_behind, other_node], [])
    await store.close()

    async with run_server(on_dynamodb(dynamodb_endpoint, table)) as running:
        rows = {i["sk"]["S"] for i in connection_items(raw, table)}
        assert rows == {"x1"}
        await running.subscribed("alice")
        await running.node.registry.drained()
        assert len(connection_items(raw, table)) == 2
    # after a graceful shutdown only the other node's row is left
    assert {i["sk"]["S"] for i in connection_items(raw, table)} == {"x1"}


async def test_clients_stay_connected_through_a_dynamodb_outage_and_nothing_is_lost(
    dynamodb_proxy: DynamoFaultProxy, table: str, raw: Any
) -> None:
    proxy = dynamodb_proxy
    async with run_server(on_dynamodb(proxy.endpoint, table)) as running:
        early = await running.subscribed("early")
        await early.wait_for(lambda: early.presence.visible == {"early"})
        proxy.fail_all("InternalServerError", 500)
        # DynamoDB fails every call: sessions still subscribe, get snapshots, stay open.
        late: list[Client] = [await running.subscribed(f"late{i}") for i in range(5)]
        await late[0].watch([("chess", "g9")])
        await late[0].barrier()
        await asyncio.sleep(1.0)
        assert all(c.ws.close_code is None for c in [early, *late])
        assert connection_items(raw, table)[0]["userId"] == {"S": "early"}
        assert running.node.metrics.value("ap_dynamodb_retries_total") > 0
        proxy.recover()
        await asyncio.wait_for(running.node.registry.drained(), timeout=30)
        items = connection_items(raw, table)
        users = sorted(i["userId"]["S"] for i in items)
        assert users == ["early"] + [f"late{i}" for i in range(5)]
        [watcher] = [i for i in items if i["userId"]["S"] == "late0"]
        assert watcher["watchingGames"] == {"SS": ["chess#g9"]}
        # presence went on too: the writer retried until the counter answered again
        await early.wait_for(lambda: len(early.presence.visible) == 6, within=30)


def test_unreachable_dynamodb_at_start_exits_non_zero_with_a_clear_message() -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "serve",
            "--dynamodb-endpoint",
            closed,
            "--port",
            "0",
            "--http-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "cannot start" in result.stderr and closed in result.stderr


def test_create_table_command_makes_the_table_with_ttl(dynamodb_endpoint: str, raw: Any) -> None:
    name = f"cli-{uuid.uuid4().hex[:12]}"
    command = [
        sys.executable,
        "-m",
        "server",
        "create-table",
        "--dynamodb-endpoint",
        dynamodb_endpoint,
        "--table",
        name,
    ]
    for _ in range(2):  # idempotent
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert f"table {name} is ready" in result.stdout
    table = raw.describe_table(TableName=name)["Table"]
    assert {k["AttributeName"]: k["KeyType"] for k in table["KeySchema"]} == {
        "pk": "HASH",
        "sk": "RANGE",
    }
    ttl = raw.describe_time_to_live(TableName=name)["TimeToLiveDescription"]
    assert ttl["AttributeName"] == "ttl" and ttl["TimeToLiveStatus"] == "ENABLED"
