"""Bots on a real cluster: node processes, one Redis, a DynamoDB table (moto).

The nodes read the bot pool's keys from a JWKS file and the bots' ``BOT`` and
``CURRENTGAMES#`` rows from the table, where the test wrote them with boto3.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest

from server.store.dynamodb import create_table
from tests.client import Client
from tests.cluster.harness import (
    DEBOUNCE_MS,
    REGION,
    Cluster,
    new_workdir,
    remove_workdir,
    wait_visible,
)
from tests.services import RedisServer
from tests.tokens import BOT_SCOPE, Pool

BOT = "cluster-bot"
ISSUER = "https://cognito-idp.us-east-1.amazonaws.com/us-east-1_ClusterBots"


@dataclass
class BotCluster:
    cluster: Cluster
    pool: Pool
    raw: Any

    async def bot(self, node: str, **subscribe: Any) -> Client:
        client = await Client.open(self.cluster.nodes[node].ws_url)
        self.cluster.clients.append(client)
        await client.send({"action": "subscribe", "token": self.pool.bot_token(BOT), **subscribe})
        return client

    def put_current_game(self, game_id: str, to_move: dict[str, Any]) -> None:
        players = [("alice", "Alice"), (BOT, "Cluster Bot")]
        self.raw.put_item(
            TableName=self.cluster.table,
            Item={
                "pk": {"S": f"CURRENTGAMES#{BOT}"},
                "sk": {"S": game_id},
                "id": {"S": game_id},
                "metaGame": {"S": "volcano"},
                "players": {
                    "L": [
                        {"M": {"id": {"S": p}, "name": {"S": n}, "time": {"N": "3600000"}}}
                        for p, n in players
                    ]
                },
                "toMove": to_move,
                "clockHard": {"BOOL": False},
                "lastMoveTime": {"N": "1764500000000"},
                "numMoves": {"N": "4"},
            },
        )


@pytest.fixture
async def bots(dynamodb_endpoint: str, fresh_redis: RedisServer) -> AsyncIterator[BotCluster]:
    redis = fresh_redis
    table = f"cluster-{uuid.uuid4().hex[:12]}"
    await create_table(dynamodb_endpoint, table, REGION)
    workdir = new_workdir()
    pool = Pool.create(ISSUER)
    jwks = workdir / "bot-jwks.json"
    jwks.write_text(json.dumps(pool.jwks()))
    raw = boto3.client("dynamodb", endpoint_url=dynamodb_endpoint, region_name=REGION)
    raw.put_item(
        TableName=table,
        Item={
            "pk": {"S": "BOT"},
            "sk": {"S": BOT},
            "name": {"S": "Cluster Bot"},
            "owner": {"S": "owner-1"},
            "endpoint": {"S": "https://bot.example/hook"},
        },
    )
    cluster = Cluster(redis, dynamodb_endpoint, table, workdir)
    flags = {"bot_cognito_issuer": ISSUER, "bot_scope": BOT_SCOPE, "bot_jwks_file": str(jwks)}
    failed = True
    try:
        for name in ("n1", "n2"):
            cluster.spawn(name, **flags)
        for name in ("n1", "n2"):
            await cluster.wait_ready(name)
        yield BotCluster(cluster, pool, raw)
        failed = False
    finally:
        await cluster.close()
        if failed or os.environ.get("AP_CLUSTER_LOGS"):
            print(cluster.logs())
        remove_workdir(workdir)


def pending(message: dict[str, Any]) -> set[str]:
    return {g["id"] for g in message["payload"]["games"]}


async def test_a_bot_on_any_node_gets_its_pending_turns_and_stays_out_of_presence(
    bots: BotCluster,
) -> None:
    bots.put_current_game("v-mine", {"S": "1"})
    bots.put_current_game("v-theirs", {"S": "0"})
    bots.put_current_game("v-simul", {"L": [{"BOOL": True}, {"BOOL": True}]})
    alice = await bots.cluster.client("n2", "alice")
    await wait_visible(alice, {"alice"}, 10, "alice's own join")
    for node in ("n1", "n2"):
        bot = await bots.bot(node)
        message = await bot.next_message(lambda m: m["verb"] == "pendingTurns", within=10)
        assert pending(message) == {"v-mine", "v-simul"}
    # the bot watches its games on its node: a move in one reaches it through the bus
    assert (
        await bots.cluster.publish(
            "n2", {"verb": "game", "payload": {"meta": "volcano", "id": "v-theirs"}}
        )
        == 202
    )
    await bot.next_message(lambda m: m["verb"] == "game", within=10)
    await asyncio.sleep(DEBOUNCE_MS / 1000 * 3)  # time for a (wrong) join of the bot
    await alice.sync_presence()
    assert alice.presence.visible == {"alice"} and alice.presence.server_total == 1


def turn(game_id: str, n: int) -> dict[str, Any]:
    return {
        "verb": "yourTurn",
        "users": [BOT],
        "payload": {"meta": "volcano", "id": game_id, "n": n},
    }


def turns_of(client: Client) -> list[int]:
    return [m["payload"]["n"] for m in client.of_verb("yourTurn")]


async def test_turns_are_replayed_after_a_bot_reconnects_to_another_node(
    bots: BotCluster,
) -> None:
    bots.put_current_game("v-mine", {"S": "0"})  # alice to move: nothing pending
    first = await bots.bot("n1")
    assert pending(await first.next_message(lambda m: m["verb"] == "pendingTurns")) == set()
    assert await bots.cluster.publish("n2", turn("v-mine", 1)) == 202
    live = await first.next_message(lambda m: m["verb"] == "yourTurn", within=10)
    assert live["stream"] == f"user:{BOT}" and live["payload"]["n"] == 1
    since = {live["stream"]: {"epoch": live["epoch"], "offset": live["offset"]}}

    bots.cluster.kill("n1")  # the bot's node dies; its turns keep coming through n2
    await first.closed(within=10)
    for n in (2, 3, 4):
        assert await bots.cluster.publish("n2", turn("v-mine", n)) == 202

    second = await bots.bot("n2", since=since)
    recovered = await second.next_message(lambda m: m["verb"] == "recovered", within=10)
    assert recovered["payload"]["recovered"] is True
    assert recovered["payload"]["offset"] == live["offset"] + 3
    assert turns_of(second) == [2, 3, 4]  # replayed in order, before "recovered"
    offsets = [m["offset"] for m in second.of_verb("yourTurn")]
    assert offsets == [live["offset"] + 1, live["offset"] + 2, live["offset"] + 3]
    await second.next_message(lambda m: m["verb"] == "pendingTurns", within=10)
    assert await bots.cluster.publish("n2", turn("v-mine", 5)) == 202
    await second.wait_for(lambda: turns_of(second) == [2, 3, 4, 5], within=10)
