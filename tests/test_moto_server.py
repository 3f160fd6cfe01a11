"""The moto launcher the tests run: conditional writes on one item are atomic, as in
DynamoDB, and SQS deletes lose no message sent meanwhile."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import uuid
from collections.abc import Iterator

import boto3
import pytest
from moto.core.models import DEFAULT_ACCOUNT_ID
from moto.dynamodb.models import DynamoDBBackend
from moto.sqs.models import sqs_backends

from loadtest.harness.moto_server import _named_item, serialise_sqs_deletes
from server.store.dynamodb import KEY_ATTRIBUTES, KEY_SCHEMA, DynamoStore
from tests.conftest import TEST_REGION, new_table
from tests.services import MotoServer, start_moto_server


@pytest.fixture(scope="module")
def own_moto() -> Iterator[MotoServer]:
    server = start_moto_server()
    try:
        yield server
    finally:
        server.stop()


async def test_racing_conditional_writes_leave_the_highest(own_moto: MotoServer) -> None:
    # Each write is "SET seq = n IF seq < n": in DynamoDB the highest always
    # stays. Unserialised moto lets two writers both pass the check, and the
    # smaller one written last wins now and then.
    table = await new_table(own_moto.endpoint)
    store = DynamoStore(table=table, region=TEST_REGION, endpoint_url=own_moto.endpoint)
    await store.start()
    try:
        rng = random.Random(7)
        top = 0
        for _ in range(8):
            numbers = list(range(top + 1, top + 33))
            rng.shuffle(numbers)
            await asyncio.gather(*(store.reserve_presence_seq(n) for n in numbers))
            top += 32
            assert await store.current_presence_seq() == top
    finally:
        await store.close()


def _request(body: bytes, *, chunked: bool = False) -> bytes:
    head = (
        "POST / HTTP/1.1\r\nHost: moto\r\n"
        "X-Amz-Target: DynamoDB_20120810.ListTables\r\n"
        "Content-Type: application/x-amz-json-1.0\r\n"
        "Authorization: AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/dynamodb/"
        "aws4_request, SignedHeaders=host, Signature=0\r\n"
    )
    if chunked:
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + (
            f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        )
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def _response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await asyncio.wait_for(reader.readexactly(length), 10)


async def test_connections_stay_open_between_requests(own_moto: MotoServer) -> None:
    # As DynamoDB's endpoint does: a client's second request (here sent at once
    # behind the first, before its answer) goes over the same connection.
    host, port = own_moto.endpoint.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(_request(b"{}") + _request(b'{"Limit": 5}'))
        await writer.drain()
        for _ in range(2):
            head, body = await _response(reader)
            assert head.startswith(b"HTTP/1.1 200")
            assert b"connection: close" not in head.lower()
            assert b"TableNames" in body
    finally:
        writer.close()


async def test_a_chunked_request_is_answered_and_then_closed(own_moto: MotoServer) -> None:
    # Its end is found by reading it, which werkzeug does itself: the launcher
    # leaves such a connection to werkzeug, which closes it after the answer.
    host, port = own_moto.endpoint.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(_request(b"{}", chunked=True))
        await writer.drain()
        head, body = await _response(reader)
        assert head.startswith(b"HTTP/1.1 200")
        assert b"TableNames" in body
        assert await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        writer.close()


async def test_updated_items_leave_no_copies_behind(own_moto: MotoServer) -> None:
    # moto's UpdateItem copies the whole item, and moto keeps every model object it
    # builds for its dashboard: 30 updates would leave 30 copies there. The launcher
    # keeps DynamoDB's out, so the dashboard (which lists what moto holds) has none.
    table = await new_table(own_moto.endpoint)
    client = boto3.client("dynamodb", endpoint_url=own_moto.endpoint, region_name=TEST_REGION)
    key = {"pk": {"S": "GAMECOMMENTS"}, "sk": {"S": "game-1"}}
    for index in range(30):
        await asyncio.to_thread(
            client.update_item,
            TableName=table,
            Key=key,
            UpdateExpression="SET #c = list_append(if_not_exists(#c, :none), :new)",
            ExpressionAttributeNames={"#c": "comments"},
            ExpressionAttributeValues={
                ":none": {"L": []},
                ":new": {"L": [{"S": f"comment {index}"}]},
            },
        )
    item = await asyncio.to_thread(client.get_item, TableName=table, Key=key)
    assert len(item["Item"]["comments"]["L"]) == 30
    host, port = own_moto.endpoint.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /moto-api/data.json HTTP/1.1\r\nHost: moto\r\n\r\n")
        await writer.drain()
        head, body = await _response(reader)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 200")
    tracked = json.loads(body)["dynamodb"]
    assert "Item" in tracked  # the dashboard still lists the model, with no instance
    assert all(instances == [] for instances in tracked.values()), {
        name: len(instances) for name, instances in tracked.items()
    }


def test_a_delete_never_drops_a_message_sent_meanwhile() -> None:
    # moto's delete rebuilds the message list from the one it began with. Paused in
    # the middle (as a thread switch does), while a second delete and a send both
    # finish, it would put back a list without the sent message. The launcher makes
    # them wait for it instead. In-process, on moto's model: the interleaving is
    # forced here, where over HTTP it takes a loaded machine and luck.
    serialise_sqs_deletes()
    backend = sqs_backends[DEFAULT_ACCOUNT_ID][TEST_REGION]
    name = f"race-{uuid.uuid4().hex[:8]}"
    backend.create_queue(name)
    queue = backend.get_queue(name)
    backend.send_message(name, "first")
    second = backend.send_message(name, "second")
    received = {m.body: m.receipt_handle for m in backend.receive_message(name, 10, 0, 30)}
    paused, resume = threading.Event(), threading.Event()
    checks_second = second.had_receipt_handle

    def pausing(handle: str) -> bool:
        if threading.current_thread() is deleter_a:
            paused.set()
            resume.wait(10)
        return checks_second(handle)

    setattr(second, "had_receipt_handle", pausing)  # noqa: B010 (an instance, not the class)
    deleter_a = threading.Thread(target=queue.delete_message, args=(received["first"],))
    deleter_a.start()
    assert paused.wait(10)
    others = [
        threading.Thread(target=queue.delete_message, args=(received["second"],)),
        threading.Thread(target=backend.send_message, args=(name, "third")),
    ]
    for thread in others:
        thread.start()
    for thread in others:
        thread.join(0.3)  # unserialised they finish now; serialised they wait for the first
    resume.set()
    for thread in (deleter_a, *others):
        thread.join(10)
    assert not any(thread.is_alive() for thread in (deleter_a, *others))
    assert [m.body for m in queue._messages] == ["third"]


async def test_partiql_updates_apply_to_the_item_they_name_and_no_other(
    own_moto: MotoServer,
) -> None:
    # The launcher shows such an UPDATE only its own item; what it writes must be
    # what moto's engine writes: the equality decides, nothing is created, the
    # rest of the table and the other tables are left as they were.
    tables = [await new_table(own_moto.endpoint) for _ in range(2)]
    client = boto3.client("dynamodb", endpoint_url=own_moto.endpoint, region_name=TEST_REGION)
    for table in tables:
        for user in ("ann", "bob", "cy"):
            item = {"pk": {"S": "USERS"}, "sk": {"S": user}, "lastSeen": {"N": "1"}}
            await asyncio.to_thread(client.put_item, TableName=table, Item=item)
    update = (
        f'UPDATE "{tables[0]}" SET "lastSeen" = ? WHERE "pk" = ? AND "sk" = ? AND "lastSeen" = ?'
    )

    def statement(user: str, read: str) -> dict[str, object]:
        parameters = [{"N": "9"}, {"S": "USERS"}, {"S": user}, {"N": read}]
        return {"Statement": update, "Parameters": parameters}

    statements = [statement("ann", "1"), statement("bob", "2"), statement("nobody", "1")]
    await asyncio.to_thread(client.batch_execute_statement, Statements=statements)

    def last_seen(table: str) -> dict[str, str]:
        items = client.scan(TableName=table, ConsistentRead=True)["Items"]
        return {item["sk"]["S"]: item["lastSeen"]["N"] for item in items}

    assert await asyncio.to_thread(last_seen, tables[0]) == {"ann": "9", "bob": "1", "cy": "1"}
    assert await asyncio.to_thread(last_seen, tables[1]) == {"ann": "1", "bob": "1", "cy": "1"}


def test_only_an_update_naming_its_whole_key_is_narrowed_to_its_item() -> None:
    backend = DynamoDBBackend(TEST_REGION, DEFAULT_ACCOUNT_ID)
    backend.create_table(
        "t",
        schema=KEY_SCHEMA,
        throughput=None,
        attr=KEY_ATTRIBUTES,
        global_indexes=None,
        indexes=None,
        streams=None,
        billing_mode="PAY_PER_REQUEST",
        sse_specification=None,
        tags=[],
        deletion_protection_enabled=False,
        warm_throughput=None,
    )
    for user in ("ann", "bob"):
        backend.put_item("t", {"pk": {"S": "USERS"}, "sk": {"S": user}, "n": {"N": "1"}})
    update = 'UPDATE "t" SET "n" = ? WHERE "pk" = ? AND "sk" = ? AND "n" = ?'
    view = _named_item(backend, update, [{"N": "2"}, {"S": "USERS"}, {"S": "bob"}, {"N": "1"}])
    assert [item.to_json()["Attributes"]["sk"] for item in view.all_items()] == [{"S": "bob"}]
    assert view.all_indexes() == [] and view.name == "t"
    missing = _named_item(backend, update, [{"N": "2"}, {"S": "USERS"}, {"S": "zed"}, {"N": "1"}])
    assert missing.all_items() == []
    # Anything else runs as moto runs it.
    no_sort_key = 'UPDATE "t" SET "n" = ? WHERE "pk" = ?'
    assert _named_item(backend, no_sort_key, [{"N": "2"}, {"S": "USERS"}]) is None
    select = 'SELECT * FROM "t" WHERE "pk" = ? AND "sk" = ?'
    assert _named_item(backend, select, [{"S": "USERS"}, {"S": "bob"}]) is None
    other = 'UPDATE "nope" SET "n" = ? WHERE "pk" = ? AND "sk" = ?'
    assert _named_item(backend, other, [{"N": "2"}, {"S": "USERS"}, {"S": "bob"}]) is None
