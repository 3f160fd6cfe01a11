"""Chat's group commit on a real node: Redis for the lock, moto (through a counting
proxy) for GAMECOMMENTS. Comments that queue while the game's lock is taken by
another holder are written together once it is free: one UpdateItem and one
append of their events, in order."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio

from server.coordination.game_lock import lock_key
from server.runtime.metrics import Registry
from tests.chat_helpers import chat_message, post, put_game_row, replies
from tests.conftest import on_dynamodb, run_server
from tests.services import DynamoFaultProxy, RedisServer

GAME = ("chess", "g1")


def authorizations(metrics: Registry) -> float:
    """Chat authorizations answered, from the kept GAME row or from a read."""
    return metrics.value("ap_chat_access_cached_total") + metrics.value(
        "ap_chat_access_reads_total"
    )


async def queued_and_authorized(metrics: Registry, target: float, within: float = 10.0) -> None:
    """``target`` authorizations answered in all, and none still running in this loop."""
    deadline = time.monotonic() + within

    def authorizing() -> bool:
        return any(t.get_name() == "chat-authorize" and not t.done() for t in asyncio.all_tasks())

    while authorizations(metrics) < target or authorizing():
        assert time.monotonic() < deadline, authorizations(metrics)
        await asyncio.sleep(0.01)


def stored(raw: Any, table: str) -> list[dict[str, Any]]:
    item = raw.get_item(
        TableName=table, Key={"pk": {"S": "GAMECOMMENTS"}, "sk": {"S": "g1"}}, ConsistentRead=True
    )["Item"]
    return [
        {"comment": c["M"]["comment"]["S"], "timeStamp": int(c["M"]["timeStamp"]["N"])}
        for c in item["comments"]["L"]
    ]


async def test_comments_queued_behind_the_lock_are_written_in_one_batch_in_order(
    dynamodb_proxy: DynamoFaultProxy, table: str, raw: Any, fresh_redis: RedisServer
) -> None:
    put_game_row(raw, table, ["alice", "bob"])
    proxy = dynamodb_proxy
    settings = on_dynamodb(proxy.endpoint, table, redis_url=fresh_redis.url, chat_rate=100)
    lock = redis.asyncio.Redis.from_url(fresh_redis.url)
    try:
        async with run_server(settings) as running:
            alice = await running.subscribed("alice", games=[GAME])
            bob = await running.subscribed("bob", games=[GAME])
            assert (await post(alice, GAME, "warm-up"))["verb"] == "chatAck"  # the item exists
            # its events too (the ack goes first), which release the lock
            await bob.wait_for(lambda: len(bob.of_verb("game")) == 1)
            batches = running.node.metrics.value("ap_chat_batches_total")
            proxy.operations.clear()
            metrics = running.node.metrics
            answered = authorizations(metrics)
            # Another holder has the game: what alice sends now waits in the queue.
            await lock.set(lock_key("chess#g1"), "someone-else", px=30_000)
            ids = [f"m{i}" for i in range(5)]
            for number, msg_id in enumerate(ids):
                await alice.send(chat_message(GAME, f"comment {number}", msg_id=msg_id))
            # Each comment is authorized once it is queued: all five are queued, and
            # authorized (the node runs in this loop: its reads are tasks here).
            await queued_and_authorized(metrics, answered + 5)
            assert proxy.operations.count("UpdateItem") == 0
            assert not any(replies(alice, m) for m in ids)
            await lock.delete(lock_key("chess#g1"))
            await alice.wait_for(lambda: all(replies(alice, m) for m in ids))
            acks = [replies(alice, m)[0] for m in ids]
            assert [a["verb"] for a in acks] == ["chatAck"] * 5
            stamps = [a["payload"]["timeStamp"] for a in acks]
            assert stamps == sorted(stamps)
            # The writer takes its batch once it holds the lock: all five in one,
            # one UpdateItem.
            assert running.node.metrics.value("ap_chat_batches_total") - batches == 1
            assert proxy.operations.count("UpdateItem") == 1
            await bob.wait_for(lambda: len(bob.of_verb("chat")) == 6)
            await bob.wait_for(lambda: len(bob.of_verb("game")) == 6)
            # Stored in the order sent; events in stored order, each chat then its hint.
            comments = [f"comment {n}" for n in range(5)]
            assert stored(raw, table)[1:] == [
                {"comment": c, "timeStamp": t} for c, t in zip(comments, stamps, strict=True)
            ]
            events = [m for m in bob.messages if m.get("verb") in ("chat", "game")][2:]
            assert [m["verb"] for m in events] == ["chat", "game"] * 5
            assert [m["payload"]["comment"] for m in events if m["verb"] == "chat"] == comments
            offsets = [m["offset"] for m in events]
            assert offsets == sorted(offsets) and len(set(offsets)) == 10
            # and the lock is free again: released by the batch's append
            assert await lock.exists(lock_key("chess#g1")) == 0
    finally:
        await lock.aclose()
