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
from moto.sqs.models import sqs_backends

from loadtest.harness.moto_server import serialise_sqs_deletes
from server.store.dynamodb import DynamoStore
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
