"""A shard that closes and a child that follows, on moto's stream behind a proxy.

Moto's stream has one shard that never closes. The proxy in front of it closes
that shard on demand (its ``DescribeStream`` gains an ending sequence number and
``GetRecords`` stops handing out a next iterator once it has nothing more) and
serves one child shard with records the test gives it, the way DynamoDB rolls a
stream's shards over every few hours.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from server.coordination.lease import MemoryLease
from server.ingress.table_stream import TableStreamReader
from server.store.dynamodb import DynamoStore
from tests.services import DynamoFaultProxy
from tests.test_table_stream import WITHIN_S, Recorder, put_notification, streamed, unstreamed
from tests.waiting import eventually

__all__ = ["streamed", "unstreamed"]  # the fixture, and the one it is made from

CHILD = "shardId-00000002000000000000-child001"


class ShardRollingProxy(DynamoFaultProxy):
    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.closed = False
        self.parent: str | None = None
        self.child_records: list[dict[str, Any]] = []

    async def _handle(self, request: Any) -> Any:
        operation = request.headers.get("X-Amz-Target", "").rpartition(".")[2]
        if self.closed and operation == "GetShardIterator":
            body = json.loads(await request.read())
            if body["ShardId"] == CHILD:
                return _json({"ShardIterator": "child:0"})
        if self.closed and operation == "GetRecords":
            body = json.loads(await request.read())
            if body["ShardIterator"].startswith("child:"):
                start = int(body["ShardIterator"].split(":")[1])
                records = self.child_records[start:]
                nxt = f"child:{start + len(records)}"
                return _json({"Records": records, "NextShardIterator": nxt})
        response = await super()._handle(request)
        if operation == "DescribeStream":
            document = json.loads(response.body)
            shards = document["StreamDescription"]["Shards"]
            self.parent = shards[0]["ShardId"]
            if self.closed:
                shards[0]["SequenceNumberRange"]["EndingSequenceNumber"] = "9" * 21
                shards.append(
                    {
                        "ShardId": CHILD,
                        "ParentShardId": self.parent,
                        "SequenceNumberRange": {"StartingSequenceNumber": "1"},
                    }
                )
            return _json(document)
        if operation == "GetRecords" and self.closed:
            document = json.loads(response.body)
            if not document.get("Records"):
                document.pop("NextShardIterator", None)  # read to its end
            return _json(document)
        return response


def _json(document: dict[str, Any]) -> web.Response:
    return web.Response(
        body=json.dumps(document).encode(), content_type="application/x-amz-json-1.0"
    )


def child_record(n: int) -> dict[str, Any]:
    return {
        "eventID": f"child-{n}",
        "eventName": "INSERT",
        "eventSource": "aws:dynamodb",
        "dynamodb": {
            "ApproximateCreationDateTime": time.time(),
            "Keys": {"pk": {"S": "NOTIFICATION#dora"}, "sk": {"S": f"{n}#child"}},
            "NewImage": {
                "pk": {"S": "NOTIFICATION#dora"},
                "sk": {"S": f"{n}#child"},
                "body": {"M": {"type": {"S": "gameStart"}, "n": {"N": str(n)}}},
            },
            "SequenceNumber": str(100 + n),
            "SizeBytes": 100,
            "StreamViewType": "NEW_AND_OLD_IMAGES",
        },
    }


def _at(checkpoints: dict[str, Any], shard: str, sequence_number: str) -> bool:
    return shard in checkpoints and checkpoints[shard].sequence_number == sequence_number


async def test_a_closed_shard_is_read_to_its_end_then_its_child(
    dynamodb_endpoint: str, raw: Any, streamed: tuple[str, DynamoStore]
) -> None:
    table, store = streamed
    proxy = ShardRollingProxy(dynamodb_endpoint)
    await proxy.start()
    recorder = Recorder()
    reader = TableStreamReader(
        store,
        MemoryLease(),
        recorder,
        table=table,
        region="us-east-1",
        endpoint_url=proxy.endpoint,
        poll_seconds=0.05,
    )
    await reader.start()
    try:
        await eventually(
            lambda: bool(reader.positioned), WITHIN_S, "the reader at the latest record"
        )
        put_notification(raw, table, "dora", 1)
        await eventually(lambda: recorder.numbers() == [1], WITHIN_S, "the parent's record")
        proxy.child_records = [child_record(2), child_record(3)]
        proxy.closed = True
        await eventually(lambda: len(recorder.numbers()) >= 3, WITHIN_S, "the child's records")
        # The checkpoint is written after the records are handled: wait for it too.
        arn = raw.describe_table(TableName=table)["Table"]["LatestStreamArn"]
        deadline = asyncio.get_running_loop().time() + 30
        while not _at(await store.stream_checkpoints(arn), CHILD, "103"):
            assert asyncio.get_running_loop().time() < deadline, "no checkpoint for the child"
            await asyncio.sleep(0.05)
    finally:
        await reader.stop()
        await proxy.stop()
    assert recorder.numbers() == [1, 2, 3]  # the parent's, then the child's, once each
    checkpoints = await store.stream_checkpoints(arn)
    assert proxy.parent is not None
    assert checkpoints[proxy.parent].done
    assert checkpoints[CHILD].sequence_number == "103" and not checkpoints[CHILD].done
