"""The bot queue bridge on one node: today's bot outbound bodies in, over real sockets.

SQS and DynamoDB are the session's moto server over HTTP, sent to with plain boto3
as ``enqueueBotOutbound`` sends; the forward queue is FIFO, as docs/operations.md
asks. Two nodes and a kill are in ``tests/cluster/test_bot_queue.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest

from server.config import Settings
from server.coordination.dedup import Claim, RedisDedup
from server.ingress.bot_queue import ROUTE_PREFIX, BotQueueBridge
from server.ingress.queue_core import QueuePolling, _Received
from server.redis.client import make_client
from server.services.bots import PRUNE_GRACE_MS
from server.store import BotRecord, CurrentGame, MemoryStore
from server.store.base import StoreUnavailable
from tests.client import Client, dev_bot_token
from tests.conftest import TEST_REGION, TEST_SETTINGS, RunningServer, new_table, run_server
from tests.queues import depth, drain_bodies, new_queue, send, send_many
from tests.services import DynamoFaultProxy, RedisServer
from tests.waiting import eventually_in_thread

BOT = "bot-q-1"
OTHER_BOT = "bot-q-2"


def bridge_settings(endpoint: str, bot_queue: str, forward_queue: str) -> Settings:
    return dataclasses.replace(
        TEST_SETTINGS,
        bot_queue_url=bot_queue,
        bot_webhook_queue_url=forward_queue,
        sqs_endpoint=endpoint,
        sqs_wait_seconds=1,
        sqs_visibility_seconds=2,
        sqs_pollers=2,
    )


@dataclass
class Bridged:
    server: RunningServer
    store: MemoryStore
    endpoint: str
    queue: str
    forward: str

    async def bot(self, bot_id: str = BOT, since: dict[str, Any] | None = None) -> Client:
        return await connect_bot(self.server, bot_id, since)

    def bridge(self) -> BotQueueBridge:
        (bridge,) = [s for s in self.server.node.services if isinstance(s, BotQueueBridge)]
        return bridge


async def connect_bot(
    server: RunningServer, bot_id: str, since: dict[str, Any] | None = None
) -> Client:
    """A bot speaking streams, once its pendingTurns arrived."""
    client = await server.client()
    await client.subscribe(
        bot_id, token=dev_bot_token(bot_id), wants_presence=False, since=since or {}
    )
    await client.next_message(lambda m: m["verb"] == "pendingTurns", within=10)
    return client


def pending_of(client: Client) -> set[tuple[str, str]]:
    (frame, *_) = [m for m in reversed(client.messages) if m["verb"] == "pendingTurns"]
    return {(g["meta"], g["id"]) for g in frame["payload"]["games"]}


def move(bot: str, game_id: str, meta: str = "chess") -> dict[str, Any]:
    """``notifyRegisteredBotsTurn``'s body, key order as the backend builds it."""
    return {"type": "move", "metaGame": meta, "gameid": game_id, "botId": bot}


def challenge(bot: str, challenge_id: str, standing: bool = False) -> dict[str, Any]:
    return {
        "type": "challenge",
        "challengeId": challenge_id,
        "metaGame": "chess",
        "botId": bot,
        "standing": standing,
    }


@pytest.fixture
async def bridged(dynamodb_endpoint: str) -> AsyncIterator[Bridged]:
    queue = new_queue(dynamodb_endpoint, "bot-outbound")
    forward = new_queue(dynamodb_endpoint, "bot-webhook", fifo=True)
    store = MemoryStore()
    for bot in (BOT, OTHER_BOT):
        store.put_bot(BotRecord(client_id=bot, name=bot, owner="owner-1"))
    settings = bridge_settings(dynamodb_endpoint, queue, forward)
    async with run_server(settings, store) as server:
        yield Bridged(server, store, dynamodb_endpoint, queue, forward)


async def test_todays_move_and_challenge_reach_a_connected_bot_with_positions(
    bridged: Bridged,
) -> None:
    bot = await bridged.bot()
    await asyncio.to_thread(send, bridged.endpoint, bridged.queue, move(BOT, "g-1"))
    turn = await bot.next_message(lambda m: m["verb"] == "yourTurn", within=15)
    assert turn["payload"] == {"meta": "chess", "id": "g-1"}
    assert (turn["stream"], turn["offset"]) == (f"user:{BOT}", 1)
    await asyncio.to_thread(send, bridged.endpoint, bridged.queue, challenge(BOT, "c-9", True))
    offer = await bot.next_message(lambda m: m["verb"] == "challenge", within=15)
    assert offer["payload"] == {"challengeId": "c-9", "meta": "chess", "standing": True}
    assert (offer["stream"], offer["offset"]) == (f"user:{BOT}", 2)
    await eventually_in_thread(
        lambda: depth(bridged.endpoint, bridged.queue) == 0, 10, "a drained queue"
    )
    # Over the socket only: nothing went on to the webhook.
    assert await asyncio.to_thread(drain_bodies, bridged.endpoint, bridged.forward) == []
    metrics = bridged.server.node.metrics
    assert metrics.value("ap_bot_queue_to_websocket_total") == 2
    assert metrics.value("ap_bot_queue_forwarded_total") == 0
    # The move left its game as the bot's candidate, for its next pendingTurns.
    assert [c.game_id for c in await bridged.store.bot_candidates(BOT)] == ["g-1"]


async def test_a_message_for_an_offline_bot_is_forwarded_unchanged_and_still_pending(
    bridged: Bridged,
) -> None:
    # Formatted as no json.dumps would: the forward must not re-encode it.
    body = '{"type": "move",  "metaGame":"chess", "gameid":"g-off", "botId":"' + BOT + '"}\n'
    bridged.store.put_game(CurrentGame("g-off", "chess", ("human-1", BOT), "1"))
    other = await bridged.bot(OTHER_BOT)  # another bot online changes nothing for this one
    await asyncio.to_thread(send, bridged.endpoint, bridged.queue, body)
    await eventually_in_thread(
        lambda: depth(bridged.endpoint, bridged.forward) == 1, 15, "a forward"
    )
    assert await asyncio.to_thread(drain_bodies, bridged.endpoint, bridged.forward) == [body]
    await other.barrier()
    assert other.of_verb("yourTurn") == []
    # The bot connects just after the forward: the turn is in its pendingTurns.
    bot = await bridged.bot()
    assert pending_of(bot) == {("chess", "g-off")}
    assert bot.of_verb("yourTurn") == []


async def test_poison_is_logged_counted_deleted_and_never_forwarded(
    bridged: Bridged, caplog: pytest.LogCaptureFixture
) -> None:
    poison = [
        "not json",
        "[1, 2]",
        json.dumps({"type": "resign", "botId": BOT, "metaGame": "chess", "gameid": "g"}),
        json.dumps({"type": "move", "metaGame": "chess", "botId": BOT}),  # no gameid
        json.dumps({"type": "move", "metaGame": "chess", "gameid": "g"}),  # no botId
        json.dumps({"type": "move", "gameid": "g", "botId": BOT}),  # no metaGame
        json.dumps({"type": "challenge", "metaGame": "chess", "botId": BOT}),  # no challengeId
    ]
    good = json.dumps(move(BOT, "g-good"))
    await asyncio.to_thread(send_many, bridged.endpoint, bridged.queue, [*poison, good])
    await eventually_in_thread(
        lambda: depth(bridged.endpoint, bridged.forward) == 1, 15, "the good one"
    )
    await eventually_in_thread(
        lambda: depth(bridged.endpoint, bridged.queue) == 0, 10, "a drained queue"
    )
    assert await asyncio.to_thread(drain_bodies, bridged.endpoint, bridged.forward) == [good]
    # Each poison message is logged by its MessageId. The bridge receives with a 2 s
    # visibility timeout here: on a loaded machine one may be received again before
    # its delete lands, and every receipt is counted, so the count is at least 7.
    found = (re.search(r"poison message (\S+) deleted", r.getMessage()) for r in caplog.records)
    logged = {match.group(1) for match in found if match is not None}
    assert len(logged) == len(poison)
    assert bridged.server.node.metrics.value("ap_bot_queue_poison_messages_total") >= len(poison)


async def test_pending_turns_come_from_candidates_and_game_rows_and_are_pruned(
    bridged: Bridged,
) -> None:
    store = bridged.store
    old = int(time.time() * 1000) - PRUNE_GRACE_MS - 1000
    rows = {
        "g-mine": CurrentGame("g-mine", "chess", ("alice", BOT), "1"),
        "g-theirs": CurrentGame("g-theirs", "chess", ("alice", BOT), "0"),
        "g-simul": CurrentGame("g-simul", "chess", (BOT, "bob", "carol"), (True, False, True)),
        "g-simul-done": CurrentGame("g-simul-done", "chess", (BOT, "bob"), (False, True)),
        "g-fresh": CurrentGame("g-fresh", "chess", ("alice", BOT), "0"),
    }
    for game in rows.values():
        store.put_game(game)
    games = ("g-mine", "g-theirs", "g-simul", "g-simul-done", "g-over")
    await store.add_bot_candidates([(BOT, "chess", game_id) for game_id in games], old)
    # Named a moment ago, before the game write that makes it the bot's turn landed.
    await store.add_bot_candidates([(BOT, "chess", "g-fresh")], int(time.time() * 1000))
    bot = await bridged.bot()
    assert pending_of(bot) == {("chess", "g-mine"), ("chess", "g-simul")}
    # Over (no active GAME row) or not the bot's turn: pruned; the fresh one is kept.
    assert {c.game_id for c in await store.bot_candidates(BOT)} == {"g-mine", "g-simul", "g-fresh"}
    # The bot moved in g-mine: not pending any more.
    store.put_game(dataclasses.replace(rows["g-mine"], to_move="0"))
    again = await bridged.bot()
    assert pending_of(again) == {("chess", "g-simul")}


async def test_the_way_chosen_first_is_kept_for_a_redelivery(
    dynamodb_endpoint: str, fresh_redis: RedisServer
) -> None:
    """A node killed after it chose "forward" (or after it forwarded, before it marked
    the message done): the message comes back while the bot is now connected, and is
    forwarded again (FIFO drops the repeat), never sent over the socket as well."""
    queue = new_queue(dynamodb_endpoint, "bot-outbound")
    forward = new_queue(dynamodb_endpoint, "bot-webhook", fifo=True)
    store = MemoryStore()
    store.put_bot(BotRecord(client_id=BOT, name=BOT, owner="o"))
    settings = dataclasses.replace(
        bridge_settings(dynamodb_endpoint, queue, forward), redis_url=fresh_redis.url
    )
    async with run_server(settings, store) as server:
        routes = RedisDedup(make_client(fresh_redis.url, retries=1))
        try:
            doomed = [str(uuid.uuid4()), str(uuid.uuid4())]
            # The dead node's decisions: the first forwarded, the second to the socket.
            assert await routes.claim([ROUTE_PREFIX + doomed[0]], "fwd", 900) == [Claim.CLAIMED]
            assert await routes.claim([ROUTE_PREFIX + doomed[1]], "ws", 900) == [Claim.CLAIMED]
        finally:
            await routes.close()
        bot = await connect_bot(server, BOT)
        (bridge,) = [s for s in server.node.services if isinstance(s, BotQueueBridge)]
        first = json.dumps(move(BOT, "g-a"))
        second = json.dumps(move(BOT, "g-b"))
        await bridge._handle([_Received(doomed[0], "r-0", first, None)])
        await bridge._handle([_Received(doomed[1], "r-1", second, None)])
        await bot.next_message(lambda m: m["verb"] == "yourTurn", within=10)
        await bot.barrier()
        assert [m["payload"]["id"] for m in bot.of_verb("yourTurn")] == ["g-b"]
        assert await asyncio.to_thread(drain_bodies, dynamodb_endpoint, forward) == [first]


async def test_one_message_read_twice_or_by_two_nodes_reaches_the_bot_once(
    dynamodb_endpoint: str, fresh_redis: RedisServer
) -> None:
    """SQS may hand one message to two consumers at once, on one node or two; with Redis
    the claims and deliveries really interleave. Once over the socket, once forwarded."""
    queue = new_queue(dynamodb_endpoint, "bot-outbound")
    forward = new_queue(dynamodb_endpoint, "bot-webhook", fifo=True)
    store = MemoryStore()
    store.put_bot(BotRecord(client_id=BOT, name=BOT, owner="o"))
    settings = dataclasses.replace(
        bridge_settings(dynamodb_endpoint, queue, forward), redis_url=fresh_redis.url
    )
    async with run_server(settings, store) as server:
        (bridge,) = [s for s in server.node.services if isinstance(s, BotQueueBridge)]
        second = BotQueueBridge(  # the other node's consumer: its own claims token
            server.node.publish,
            server.node.bus,
            RedisDedup(make_client(fresh_redis.url, retries=1)),
            store,
            server.node.bots.sessions,
            QueuePolling(
                queue,
                node_id="other-node",
                region=TEST_REGION,
                endpoint_url=dynamodb_endpoint,
                pollers=1,
                wait_seconds=1,
                visibility_seconds=2,
            ),
            forward,
            metrics=server.node.metrics,
        )
        await second.start()
        try:
            # Offline: two copies of one message, forwarded once.
            offline = json.dumps(move(BOT, "g-off"))
            message_id = str(uuid.uuid4())
            copies = [_Received(message_id, f"r-{i}", offline, None) for i in range(3)]
            await asyncio.gather(
                bridge._handle([copies[0]]),
                bridge._handle([copies[1]]),
                second._handle([copies[2]]),
            )
            bot = await connect_bot(server, BOT)
            # Online: two copies, one yourTurn.
            online = json.dumps(move(BOT, "g-on"))
            message_id = str(uuid.uuid4())
            copies = [_Received(message_id, f"r-{i}", online, None) for i in range(3)]
            await asyncio.gather(
                bridge._handle([copies[0]]),
                bridge._handle([copies[1]]),
                second._handle([copies[2]]),
            )
            await bot.next_message(lambda m: m["verb"] == "yourTurn", within=10)
            await asyncio.sleep(0.5)
            await bot.barrier()
        finally:
            await second.stop()
        assert [m["payload"]["id"] for m in bot.of_verb("yourTurn")] == ["g-on"]
        assert await asyncio.to_thread(drain_bodies, dynamodb_endpoint, forward) == [offline]


async def test_pending_turns_on_dynamodb_in_the_production_shapes(dynamodb_endpoint: str) -> None:
    """GAME rows as submitMove writes them (players with id, name and time; toMove a
    string, or one flag per player), candidates left by move messages for an offline
    bot, a simultaneous game, a game over, and the list after the bot has moved."""
    table = await new_table(dynamodb_endpoint)
    raw = boto3.client("dynamodb", endpoint_url=dynamodb_endpoint, region_name=TEST_REGION)

    def player(uid: str) -> dict[str, Any]:
        return {"M": {"id": {"S": uid}, "name": {"S": uid.title()}, "time": {"N": "86400000"}}}

    def game_row(game_id: str, players: list[str], to_move: Any, over: bool = False) -> None:
        raw.put_item(
            TableName=table,
            Item={
                "pk": {"S": "GAME"},
                "sk": {"S": f"chess#{1 if over else 0}#{game_id}"},
                "id": {"S": game_id},
                "metaGame": {"S": "chess"},
                "numPlayers": {"N": str(len(players))},
                "players": {"L": [player(p) for p in players]},
                "toMove": to_move,
                "state": {"S": '{"big": "engine state"}'},
                "clockHard": {"BOOL": True},
            },
        )

    raw.put_item(
        TableName=table,
        Item={
            "pk": {"S": "BOT"},
            "sk": {"S": BOT},
            "name": {"S": "Prod"},
            "endpoint": {"S": "https://bot.example/hook"},
            "owner": {"S": "owner-1"},
            "lastseen": {"N": "0"},
        },
    )
    game_row("g-turn", ["alice", BOT], {"S": "1"})
    game_row("g-simul", [BOT, "bob"], {"L": [{"BOOL": True}, {"BOOL": True}]})
    game_row("g-wait", [BOT, "bob"], {"S": "1"})
    game_row("g-over", [BOT, "bob"], {"S": ""}, over=True)  # the #0# row was deleted
    queue = new_queue(dynamodb_endpoint, "bot-outbound")
    forward = new_queue(dynamodb_endpoint, "bot-webhook", fifo=True)
    settings = dataclasses.replace(
        bridge_settings(dynamodb_endpoint, queue, forward),
        store="dynamodb",
        dynamodb_endpoint=dynamodb_endpoint,
        table=table,
    )
    async with run_server(settings) as server:
        (bridge,) = [s for s in server.node.services if isinstance(s, BotQueueBridge)]
        # Its candidate writes have a client of their own, not queued behind the node's.
        assert bridge._store is not server.node.store
        bodies = [move(BOT, g) for g in ("g-turn", "g-simul", "g-wait", "g-over")]
        bodies.append(move(BOT, "g-turn"))  # an admin ping_bot re-send: no harm
        await asyncio.to_thread(send_many, dynamodb_endpoint, queue, bodies)
        await eventually_in_thread(lambda: depth(dynamodb_endpoint, forward) == 5, 20, "5 forwards")
        # The candidates, as the bridge wrote them: one per game however often named.
        items = raw.query(
            TableName=table,
            KeyConditionExpression="pk = :pk",
            ExpressionAttributeValues={":pk": {"S": f"BOTTURNS#{BOT}"}},
        )["Items"]
        assert {i["sk"]["S"] for i in items} == {"g-turn", "g-simul", "g-wait", "g-over"}
        assert all(set(i) == {"pk", "sk", "metaGame", "addedAt", "ttl"} for i in items)
        bot = await connect_bot(server, BOT)
        assert pending_of(bot) == {("chess", "g-turn"), ("chess", "g-simul")}
        # The bot moves in g-turn and in the simultaneous game: neither is pending now.
        game_row("g-turn", ["alice", BOT], {"S": "0"})
        game_row("g-simul", [BOT, "bob"], {"L": [{"BOOL": False}, {"BOOL": True}]})
        again = await connect_bot(server, BOT)
        assert pending_of(again) == set()
        # Candidates older than the grace that are over or not the bot's turn go.
        old = str(int(time.time() * 1000) - PRUNE_GRACE_MS - 1000)
        for game_id in ("g-turn", "g-simul", "g-wait", "g-over"):
            raw.update_item(
                TableName=table,
                Key={"pk": {"S": f"BOTTURNS#{BOT}"}, "sk": {"S": game_id}},
                UpdateExpression="SET addedAt = :old",
                ExpressionAttributeValues={":old": {"N": old}},
            )
        game_row("g-simul", [BOT, "bob"], {"L": [{"BOOL": True}, {"BOOL": False}]})
        third = await connect_bot(server, BOT)
        assert pending_of(third) == {("chess", "g-simul")}
        left = raw.query(
            TableName=table,
            KeyConditionExpression="pk = :pk",
            ExpressionAttributeValues={":pk": {"S": f"BOTTURNS#{BOT}"}},
        )["Items"]
        assert {i["sk"]["S"] for i in left} == {"g-simul"}
    with pytest.raises(StoreUnavailable):  # closed with the node
        await bridge._store.bot_candidates(BOT)


async def test_a_bot_that_closed_its_socket_is_forwarded_to_again(bridged: Bridged) -> None:
    bot = await bridged.bot()
    sessions = bridged.server.node.bots.sessions
    assert await sessions.connected(BOT)
    await bot.close()
    deadline = time.monotonic() + 10
    while await sessions.connected(BOT):
        assert time.monotonic() < deadline, "the mark outlived the bot's only socket"
        await asyncio.sleep(0.05)
    body = json.dumps(move(BOT, "g-after"))
    await asyncio.to_thread(send, bridged.endpoint, bridged.queue, body)
    await eventually_in_thread(
        lambda: depth(bridged.endpoint, bridged.forward) == 1, 15, "a forward"
    )
    assert await asyncio.to_thread(drain_bodies, bridged.endpoint, bridged.forward) == [body]


async def test_challenges_by_webhook_go_to_the_webhook_even_for_a_connected_bot(
    dynamodb_endpoint: str,
) -> None:
    # Today only the webhook's 200 accepts a challenge: with the flag a connected bot
    # still gets its turns over the socket, and its challenges by webhook, once each.
    queue = new_queue(dynamodb_endpoint, "bot-outbound")
    forward = new_queue(dynamodb_endpoint, "bot-webhook", fifo=True)
    store = MemoryStore()
    store.put_bot(BotRecord(client_id=BOT, name=BOT, owner="owner-1"))
    settings = dataclasses.replace(
        bridge_settings(dynamodb_endpoint, queue, forward), bot_challenges_by_webhook=True
    )
    async with run_server(settings, store) as server:
        bot = await connect_bot(server, BOT)
        offer = json.dumps(challenge(BOT, "c-web"))
        await asyncio.to_thread(send, dynamodb_endpoint, queue, offer)
        await asyncio.to_thread(send, dynamodb_endpoint, queue, move(BOT, "g-web"))
        turn = await bot.next_message(lambda m: m["verb"] == "yourTurn", within=15)
        assert turn["payload"] == {"meta": "chess", "id": "g-web"}
        await eventually_in_thread(
            lambda: depth(dynamodb_endpoint, queue) == 0, 10, "a drained queue"
        )
        assert await asyncio.to_thread(drain_bodies, dynamodb_endpoint, forward) == [offer]
        await bot.barrier()
        assert bot.of_verb("challenge") == []
        metrics = server.node.metrics
        assert metrics.value("ap_bot_queue_forwarded_total") == 1
        assert metrics.value("ap_bot_queue_to_websocket_total") == 1


async def forwarded_once(endpoint: str, queue: str, forward: str, body: dict[str, Any]) -> None:
    """Send ``body`` to the bot queue; once it is drained, the forward queue holds
    exactly that body, once."""
    text = json.dumps(body)
    await asyncio.to_thread(send, endpoint, queue, text)
    await eventually_in_thread(lambda: depth(endpoint, queue) == 0, 30, "a drained queue")
    assert await asyncio.to_thread(drain_bodies, endpoint, forward) == [text]


async def test_a_refused_forward_and_a_refused_hand_back_still_forward_once(
    dynamodb_endpoint: str, dynamodb_proxy: DynamoFaultProxy
) -> None:
    """SQS refuses the forward of a message for an offline bot, then the hand-back of
    that message (a reset of its visibility): it waits out its visibility timeout,
    comes back, and is forwarded once."""
    queue = new_queue(dynamodb_endpoint, "bot-outbound")
    forward = new_queue(dynamodb_endpoint, "bot-webhook", fifo=True)
    store = MemoryStore()
    store.put_bot(BotRecord(client_id=BOT, name=BOT, owner="owner-1"))
    proxy = dynamodb_proxy
    settings = bridge_settings(proxy.endpoint, queue, forward)
    async with run_server(settings, store) as server:
        # Errors botocore does not retry, so the bridge sees each of them.
        proxy.fail_operation("SendMessage", 1, "InvalidParameterValue", 400)
        proxy.fail_operation("ChangeMessageVisibilityBatch", 1, "InvalidParameterValue", 400)
        await forwarded_once(dynamodb_endpoint, queue, forward, move(BOT, "g-refused"))
        assert proxy.injected == {"InvalidParameterValue": 2}
        metrics = server.node.metrics
        assert metrics.value("ap_bot_queue_errors_total") >= 2
        assert metrics.value("ap_bot_queue_forwarded_total") == 1
        # Twice at least: a loaded machine may let its visibility lapse once more.
        assert metrics.value("ap_bot_queue_messages_received_total") >= 2


async def test_a_refused_candidate_write_hands_the_batch_back_undelivered(
    dynamodb_endpoint: str, dynamodb_proxy: DynamoFaultProxy
) -> None:
    """DynamoDB refuses the ``BOTTURNS#`` candidate write of a move for an offline
    bot. Nothing of that batch is forwarded (a bot connecting after a forward must
    find its turn in ``pendingTurns``): the message comes back after its
    visibility timeout, its candidate is written, and it is forwarded once."""
    table = await new_table(dynamodb_endpoint)
    raw = boto3.client("dynamodb", endpoint_url=dynamodb_endpoint, region_name=TEST_REGION)
    raw.put_item(
        TableName=table,
        Item={"pk": {"S": "BOT"}, "sk": {"S": BOT}, "name": {"S": BOT}, "owner": {"S": "o"}},
    )
    queue = new_queue(dynamodb_endpoint, "bot-outbound")
    forward = new_queue(dynamodb_endpoint, "bot-webhook", fifo=True)
    settings = dataclasses.replace(
        bridge_settings(dynamodb_endpoint, queue, forward),
        store="dynamodb",
        dynamodb_endpoint=dynamodb_proxy.endpoint,
        table=table,
    )
    async with run_server(settings) as server:
        # Not a transient error: the store gives up at once, so the bridge sees it.
        dynamodb_proxy.fail_operation("BatchWriteItem", 1, "AccessDeniedException", 400)
        await forwarded_once(dynamodb_endpoint, queue, forward, move(BOT, "g-refused"))
        assert dynamodb_proxy.injected == {"AccessDeniedException": 1}
        assert dynamodb_proxy.count("BatchWriteItem") == 2  # refused, then written
        candidates = raw.query(
            TableName=table,
            KeyConditionExpression="pk = :pk",
            ExpressionAttributeValues={":pk": {"S": f"BOTTURNS#{BOT}"}},
        )["Items"]
        assert [item["sk"]["S"] for item in candidates] == ["g-refused"]
        metrics = server.node.metrics
        assert metrics.value("ap_bot_queue_errors_total") >= 1
        assert metrics.value("ap_bot_queue_candidates_total") == 1
        assert metrics.value("ap_bot_queue_forwarded_total") == 1
        assert metrics.value("ap_bot_queue_messages_received_total") >= 2
