"""Chat, marks and lastSeen on DynamoDB (moto over HTTP), read back with plain boto3."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from protocol.chat import comment_weight
from server.services.game_access import FRESH_SECONDS, STALE_SECONDS
from server.store.dynamodb import DynamoStore
from server.store.records import comment_key
from tests.chat_helpers import complete_game, post
from tests.conftest import RunningServer, on_dynamodb, run_server
from tests.rows import Rows
from tests.services import DynamoFaultProxy

GAME = ("chess", "g1")


@pytest.fixture
async def dynamo_server(dynamodb_endpoint: str, table: str) -> AsyncIterator[RunningServer]:
    async with run_server(on_dynamodb(dynamodb_endpoint, table)) as running:
        yield running


def put(raw: Any, table: str, pk: str, sk: str, **attributes: Any) -> None:
    raw.put_item(TableName=table, Item={"pk": {"S": pk}, "sk": {"S": sk}, **attributes})


def get(raw: Any, table: str, pk: str, sk: str) -> dict[str, Any] | None:
    item: dict[str, Any] | None = raw.get_item(
        TableName=table, Key={"pk": {"S": pk}, "sk": {"S": sk}}, ConsistentRead=True
    ).get("Item")
    return item


def seed_game(raw: Any, table: str, players: list[str], *, completed: bool = False) -> None:
    meta, game_id = GAME
    put(
        raw,
        table,
        "GAME",
        f"{meta}#{1 if completed else 0}#{game_id}",
        players={"L": [{"M": {"id": {"S": p}, "name": {"S": p.title()}}} for p in players]},
        state={"S": "{}" * 2000},
    )


def typed_comment(text: str, user: str, move: int, ts: int) -> dict[str, Any]:
    return {
        "M": {
            "comment": {"S": text},
            "userId": {"S": user},
            "moveNumber": {"N": str(move)},
            "timeStamp": {"N": str(ts)},
        }
    }


async def test_a_comment_is_one_item_of_the_live_shape(
    dynamo_server: RunningServer, raw: Any, table: str
) -> None:
    seed_game(raw, table, ["alice", "bob"])
    alice = await dynamo_server.subscribed("alice", games=[GAME])
    first = await post(alice, GAME, "first ✓", msg_id="m1", move=2)
    second = await post(alice, GAME, "second", msg_id="m2", move=3)
    assert first["verb"] == second["verb"] == "chatAck"
    ts1, ts2 = first["payload"]["timeStamp"], second["payload"]["timeStamp"]
    item = get(raw, table, "GAMECOMMENTS", "g1")
    assert item == {
        "pk": {"S": "GAMECOMMENTS"},
        "sk": {"S": "g1"},
        "comments": {
            "L": [
                typed_comment("first ✓", "alice", 2, ts1),
                typed_comment("second", "alice", 3, ts2),
            ]
        },
        "commentBytes": {"N": str(comment_weight("first ✓") + comment_weight("second"))},
        "commentIds": {
            "M": {
                comment_key("alice", "m1"): {"N": str(ts1)},
                comment_key("alice", "m2"): {"N": str(ts2)},
            }
        },
    }
    again = await post(alice, GAME, "second", msg_id="m2", move=3)
    assert again == second  # the same ack: stored once
    assert get(raw, table, "GAMECOMMENTS", "g1") == item


async def test_authorization_on_dynamodb(
    dynamo_server: RunningServer, raw: Any, table: str
) -> None:
    seed_game(raw, table, ["alice", "bob"])
    put(raw, table, "GAME", "chess#1#done", players={"L": [{"M": {"id": {"S": "alice"}}}]})
    put(raw, table, "USER", "root", admin={"BOOL": True})
    put(raw, table, "USER", "carol", admin={"BOOL": False})
    carol = await dynamo_server.subscribed("carol")
    root = await dynamo_server.subscribed("root")
    alice = await dynamo_server.subscribed("alice")
    assert (await post(carol, GAME, "no"))["payload"]["code"] == "not_allowed"
    assert (await post(root, GAME, "yes"))["verb"] == "chatAck"
    assert (await post(alice, ("chess", "done"), "gg"))["payload"]["code"] == "game_completed"
    assert (await post(alice, ("chess", "zz"), "hi"))["payload"]["code"] == "game_not_found"
    item = get(raw, table, "GAMECOMMENTS", "g1")
    assert item is not None and [c["M"]["userId"]["S"] for c in item["comments"]["L"]] == ["root"]
    assert get(raw, table, "GAMECOMMENTS", "done") is None


async def test_the_cap_on_dynamodb(dynamo_server: RunningServer, raw: Any, table: str) -> None:
    # The near-cap item without a counter is in the store contract suite; moto is slow
    # with thousands of list elements, so this one starts from a counted item.
    seed_game(raw, table, ["alice"])
    put(
        raw,
        table,
        "GAMECOMMENTS",
        "g1",
        comments={"L": [typed_comment("x", "u", 1, 1)]},
        commentBytes={"N": "359700"},
        commentIds={"M": {}},
    )
    before = get(raw, table, "GAMECOMMENTS", "g1")
    alice = await dynamo_server.subscribed("alice")

    full = await post(alice, GAME, "y" * 190, msg_id="big")
    assert full["payload"] == {
        "code": "comments_full",
        "message": "this game's comments are full; no more can be added",
        "clientMsgId": "big",
    }
    assert get(raw, table, "GAMECOMMENTS", "g1") == before

    fits = await post(alice, GAME, "z" * 189)
    assert fits["verb"] == "chatAck"
    item = get(raw, table, "GAMECOMMENTS", "g1")
    assert item is not None
    assert item["commentBytes"] == {"N": "359999"}
    assert len(item["comments"]["L"]) == 2

    assert (await post(alice, GAME, "!"))["payload"]["code"] == "comments_full"
    assert get(raw, table, "GAMECOMMENTS", "g1") == item


async def test_dashboard_marks_read_back_with_boto3(
    dynamo_server: RunningServer, raw: Any, table: str
) -> None:
    seed_game(raw, table, ["alice", "bob", "botty"])
    for player in ("alice", "bob", "botty"):
        put(raw, table, f"CURRENTGAMES#{player}", "g1", id={"S": "g1"})
    put(raw, table, "BOT", "botty", name={"S": "Botty"})
    put(raw, table, "USERGAME#bob", "g1", seen={"N": "5"})
    for watcher in ("spec", "gone"):
        put(raw, table, "GAMEWATCHERS#g1", watcher)
    put(raw, table, "WATCHED#spec", "g1", addedAt={"N": "1"}, metaGame={"S": "chess"})
    alice = await dynamo_server.subscribed("alice")
    ts = (await post(alice, GAME, "mark"))["payload"]["timeStamp"]
    await dynamo_server.node.chat_marks.drained()

    def attrs(pk: str) -> dict[str, Any] | None:
        item = get(raw, table, pk, "g1")
        return None if item is None else {k: v for k, v in item.items() if k not in ("pk", "sk")}

    assert attrs("USERGAME#alice") == {"lastChat": {"N": str(ts)}, "seen": {"N": str(ts + 10)}}
    assert attrs("USERGAME#bob") == {"lastChat": {"N": str(ts)}, "seen": {"N": "5"}}
    assert attrs("USERGAME#botty") is None
    assert attrs("WATCHED#spec") == {
        "addedAt": {"N": "1"},
        "metaGame": {"S": "chess"},
        "lastChat": {"N": str(ts)},
    }
    assert attrs("WATCHED#gone") is None  # no phantom row for a stale index entry


def last_seen_writes(server: RunningServer) -> float:
    return server.node.metrics.value("ap_last_seen_writes_total")


async def test_last_seen_at_most_once_per_quarter_hour(
    dynamo_server: RunningServer, raw: Any, table: str
) -> None:
    put(raw, table, "USERS", "alice", name={"S": "Alice"})
    writes = last_seen_writes(dynamo_server)
    alice = await dynamo_server.subscribed("alice")
    await dynamo_server.node.last_seen.drained()
    item = get(raw, table, "USERS", "alice")
    assert item is not None and int(item["lastSeen"]["N"]) > 1_700_000_000_000
    assert last_seen_writes(dynamo_server) == writes + 1
    # Stale behind the node's back: a syncPresence and more tabs still write nothing.
    put(raw, table, "USERS", "alice", name={"S": "Alice"}, lastSeen={"N": "1"})
    await alice.sync_presence()
    for _ in range(3):
        await dynamo_server.subscribed("alice")
    await dynamo_server.node.last_seen.drained()
    assert get(raw, table, "USERS", "alice") == {
        "pk": {"S": "USERS"},
        "sk": {"S": "alice"},
        "name": {"S": "Alice"},
        "lastSeen": {"N": "1"},
    }
    assert last_seen_writes(dynamo_server) == writes + 1
    # A user without a USERS row gets none.
    await dynamo_server.subscribed("ghost")
    await dynamo_server.node.last_seen.drained()
    assert get(raw, table, "USERS", "ghost") is None


async def test_a_store_outage_answers_unavailable_and_the_retry_is_stored_once(
    dynamodb_proxy: DynamoFaultProxy, table: str, raw: Any
) -> None:
    seed_game(raw, table, ["alice"])
    proxy = dynamodb_proxy
    async with run_server(on_dynamodb(proxy.endpoint, table)) as running:
        alice = await running.subscribed("alice", games=[GAME])
        # The append's own request fails with a throttle, then goes through on retry.
        proxy.fail_next(2, "ThrottlingException", 400)
        assert (await post(alice, GAME, "through a throttle", msg_id="t1"))["verb"] == "chatAck"
        proxy.fail_all("InternalServerError", 500)
        down = await post(alice, GAME, "during the outage", msg_id="o1", within=60)
        assert down["verb"] == "error"
        assert down["payload"]["code"] == "unavailable"
        assert down["payload"]["clientMsgId"] == "o1"
        # A game not read before: its authorization read is what fails.
        unread = await post(alice, ("chess", "g2"), "unread", msg_id="o2", within=60)
        assert unread["verb"] == "error" and unread["payload"]["code"] == "unavailable"
        proxy.recover()
        again = await post(alice, GAME, "during the outage", msg_id="o1")
        assert again["verb"] == "chatAck"
        await alice.barrier()
    item = get(raw, table, "GAMECOMMENTS", "g1")
    assert item is not None
    assert [c["M"]["comment"]["S"] for c in item["comments"]["L"]] == [
        "through a throttle",
        "during the outage",
    ]


async def test_a_busy_game_is_read_once_a_second_at_most_and_its_end_refused_within_stale(
    dynamodb_endpoint: str, dynamodb_proxy: DynamoFaultProxy, table: str, raw: Any
) -> None:
    seed_game(raw, table, ["alice", "bob"])
    proxy = dynamodb_proxy
    async with run_server(on_dynamodb(proxy.endpoint, table, chat_rate=100)) as running:
        alice = await running.subscribed("alice", games=[GAME])
        proxy.operations.clear()
        started = time.monotonic()
        for number in range(10):
            assert (await post(alice, GAME, f"comment {number}"))["verb"] == "chatAck"
        elapsed = time.monotonic() - started
        # One read, then one behind the comments each time the kept row is past fresh.
        reads = proxy.operations.count("GetItem")
        assert 1 <= reads <= 1 + math.ceil(elapsed / FRESH_SECONDS), (reads, elapsed)
        ended = time.monotonic()
        # Straight to moto: a blocking call through the proxy (in this loop) would hang.
        complete_game(Rows(DynamoStore(table=table, endpoint_url=dynamodb_endpoint)), GAME)
        sent_acked: list[float] = []
        while True:
            sent = time.monotonic()
            reply = await post(alice, GAME, "still on?")
            if reply["verb"] == "error":
                assert reply["payload"]["code"] == "game_completed"
                break
            sent_acked.append(sent - ended)
            assert sent - ended < 2 * STALE_SECONDS, sent_acked
            await asyncio.sleep(0.1)
        # Every comment was judged on a read begun at most STALE_SECONDS before it.
        assert all(after < STALE_SECONDS for after in sent_acked), sent_acked
