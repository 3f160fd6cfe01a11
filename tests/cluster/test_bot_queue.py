"""The bot queue bridge on two node processes, one killed mid-stream.

Both nodes consume one moto bot queue. A bot on the survivor, a bot on the node that
is killed (it reconnects to the survivor with ``since``) and a bot with no socket
(its messages go on to the FIFO forward queue): every turn reaches its bot exactly
once, over WebSocket or forwarded, never both.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import boto3
import pytest

from tests.client import Client, dev_bot_token
from tests.cluster.conftest import nodes_on
from tests.cluster.harness import REGION, Cluster
from tests.queues import depth, drain_bodies, new_queue, send_many
from tests.services import RedisServer
from tests.waiting import eventually

NODES = ("b1", "b2")
STAYS, MOVES, AWAY = "bot-stays", "bot-moves", "bot-away"
TURNS = 120  # per bot


@pytest.fixture
async def bridged(
    request: pytest.FixtureRequest, dynamodb_endpoint: str, fresh_redis: RedisServer
) -> AsyncIterator[tuple[Cluster, str, str]]:
    queue = new_queue(dynamodb_endpoint, "bot-outbound")
    forward = new_queue(dynamodb_endpoint, "bot-webhook", fifo=True)
    async with nodes_on(
        fresh_redis,
        request,
        dynamodb_endpoint,
        NODES,
        bot_queue_url=queue,
        bot_webhook_queue_url=forward,
        sqs_endpoint=dynamodb_endpoint,
        sqs_wait_seconds=1,
        sqs_visibility_seconds=3,
        sqs_pollers=2,
    ) as cluster:
        raw = boto3.client("dynamodb", endpoint_url=dynamodb_endpoint, region_name=REGION)
        for bot in (STAYS, MOVES, AWAY):
            raw.put_item(
                TableName=cluster.table,
                Item={"pk": {"S": "BOT"}, "sk": {"S": bot}, "name": {"S": bot}},
            )
        yield cluster, queue, forward


async def bot_on(cluster: Cluster, node: str, bot: str, since: dict[str, Any]) -> Client:
    client = await Client.open(cluster.nodes[node].ws_url)
    cluster.clients.append(client)
    await client.subscribe(bot, token=dev_bot_token(bot), wants_presence=False, since=since)
    await client.next_message(lambda m: m["verb"] == "pendingTurns", within=15)
    return client


def turns(*clients: Client) -> list[str]:
    return [m["payload"]["id"] for c in clients for m in c.of_verb("yourTurn")]


def bodies_for(bot: str) -> list[dict[str, Any]]:
    return [
        {"type": "move", "metaGame": "chess", "gameid": f"{bot}-{n}", "botId": bot}
        for n in range(TURNS)
    ]


async def test_a_node_killed_mid_stream_costs_no_turn_and_no_repeat(
    bridged: tuple[Cluster, str, str],
) -> None:
    cluster, queue, forward = bridged
    endpoint = cluster.dynamodb_endpoint
    stays = await bot_on(cluster, "b2", STAYS, {})
    moves = await bot_on(cluster, "b1", MOVES, {})
    interleaved = [
        body
        for trio in zip(bodies_for(STAYS), bodies_for(MOVES), bodies_for(AWAY), strict=True)
        for body in trio
    ]
    sender = asyncio.create_task(asyncio.to_thread(send_many, endpoint, queue, interleaved))
    await eventually(lambda: len(turns(stays)) >= 20, 30, "the first turns")
    deadline = time.monotonic() + 30
    while await cluster.metric("b1", "ap_bot_queue_messages_received_total") == 0:
        assert time.monotonic() < deadline, "b1 consumed nothing"
        await asyncio.sleep(0.1)
    cluster.kill("b1")  # most likely with messages received and not yet deleted
    # The bot on b1 notices and comes back on b2 from where it was.
    await moves.closed(within=10)
    mine = [m for m in moves.on_stream(f"user:{MOVES}") if m["verb"] == "yourTurn"]
    since = {f"user:{MOVES}": {"epoch": mine[-1]["epoch"], "offset": mine[-1]["offset"]}}
    back = await bot_on(cluster, "b2", MOVES, since if mine else {})
    await sender
    expected = {bot: {b["gameid"] for b in bodies_for(bot)} for bot in (STAYS, MOVES, AWAY)}
    await eventually(lambda: set(turns(stays)) == expected[STAYS], 60, "every turn of the stayer")
    await eventually(lambda: set(turns(moves, back)) == expected[MOVES], 60, "the mover's turns")
    # The forward queue is read only once the bot queue is empty. SQS drops a
    # FIFO send whose deduplication id it saw in the last 5 minutes, read or
    # not; moto drops it only while the first copy is still in the queue. Read
    # earlier, a resend by the survivor that SQS would drop could get through.
    await eventually(lambda: depth(endpoint, queue) == 0, 60, "a drained bot queue")
    await asyncio.sleep(1.5)  # room for a repeat to show up
    for client in (stays, back):
        await client.barrier()
    forwarded: list[str] = []
    deadline = time.monotonic() + 60
    while len(forwarded) < TURNS and time.monotonic() < deadline:
        forwarded += await asyncio.to_thread(drain_bodies, endpoint, forward)
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)
    forwarded += await asyncio.to_thread(drain_bodies, endpoint, forward)
    # Exactly once, counting both ways together.
    assert sorted(turns(stays)) == sorted(expected[STAYS])
    assert sorted(turns(moves, back)) == sorted(expected[MOVES])
    assert sorted(json.loads(b)["gameid"] for b in forwarded) == sorted(expected[AWAY])
    for client, bot in ((stays, STAYS), (back, MOVES)):
        offsets = [m["offset"] for m in client.on_stream(f"user:{bot}")]
        assert offsets == sorted(set(offsets)), "a position seen twice"
