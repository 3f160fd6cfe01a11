"""Chat across a real cluster: node processes, one Redis, one DynamoDB table (moto)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from server.store.dynamodb import create_table
from tests.chat_helpers import chat_message, post, put_game_row, replies
from tests.client import Client
from tests.cluster.harness import REGION, SLACK, Cluster, new_workdir, remove_workdir
from tests.services import RedisServer
from tests.waiting import eventually

GAME = ("chess", "g1")


@pytest.fixture
async def chat_cluster(
    request: pytest.FixtureRequest, dynamodb_endpoint: str, fresh_redis: RedisServer
) -> AsyncIterator[Cluster]:
    """Two nodes; ``chat_rate`` from the test's parameter (default 20)."""
    rate = getattr(request, "param", 20)
    redis = fresh_redis
    table = f"chat-{uuid.uuid4().hex[:12]}"
    await create_table(dynamodb_endpoint, table, REGION)
    workdir = new_workdir()
    running = Cluster(redis, dynamodb_endpoint, table, workdir)
    failed = True
    try:
        for name in ("n1", "n2"):
            running.spawn(name, chat_rate=rate)
        for name in ("n1", "n2"):
            await running.wait_ready(name)
        yield running
        failed = False
    finally:
        await running.close()
        if failed:
            print(running.logs())
        remove_workdir(workdir)


def stored_comments(raw: Any, table: str) -> list[str]:
    item = raw.get_item(
        TableName=table,
        Key={"pk": {"S": "GAMECOMMENTS"}, "sk": {"S": "g1"}},
        ConsistentRead=True,
    ).get("Item")
    return [] if item is None else [c["M"]["comment"]["S"] for c in item["comments"]["L"]]


async def test_concurrent_posts_on_two_nodes_are_stored_once_in_event_order(
    chat_cluster: Cluster, raw: Any
) -> None:
    players = [f"p{i:02d}" for i in range(20)]
    comments = [f"{p}-{i}" for p in players for i in range(10)]
    put_game_row(raw, chat_cluster.table, players)
    watchers = [await chat_cluster.client(n, f"w-{n}", games=[GAME]) for n in ("n1", "n2")]
    clients = [
        await chat_cluster.client("n1" if i % 2 == 0 else "n2", player)
        for i, player in enumerate(players)
    ]

    async def burst(client: Client, player: str) -> None:
        for i in range(10):
            await client.send(chat_message(GAME, f"{player}-{i}", msg_id=f"{player}-{i}"))

    await asyncio.gather(*(burst(c, p) for c, p in zip(clients, players, strict=True)))
    for client, player in zip(clients, players, strict=True):
        ids = [f"{player}-{i}" for i in range(10)]

        def answered(client: Client = client, ids: list[str] = ids) -> bool:
            return all(replies(client, m) for m in ids)

        await client.wait_for(answered, within=90)
        assert [replies(client, m)[0]["verb"] for m in ids] == ["chatAck"] * 10
    for watcher in watchers:

        def all_seen(watcher: Client = watcher) -> bool:
            return len(watcher.of_verb("chat")) >= 200

        try:
            await watcher.wait_for(all_seen, within=30)
        except TimeoutError as timeout:
            # Seen once at load 11 (every comment acked, a watcher short): say how short.
            seen = Counter(m["payload"].get("comment") for m in watcher.of_verb("chat"))
            missing = sorted(set(comments) - set(seen))
            raise AssertionError(
                f"{sum(seen.values())} chat events, {len(seen)} distinct of 200; "
                f"missing {missing[:20]}\n{chat_cluster.logs()}"
            ) from timeout

    stored = stored_comments(raw, chat_cluster.table)
    assert len(stored) == 200
    assert sorted(stored) == sorted(comments)
    offsets_by_node = []
    for watcher in watchers:
        events = watcher.of_verb("chat")
        assert [m["payload"]["comment"] for m in events] == stored
        # Every chat event has its place on the game's stream, and sorting the
        # events by that place gives exactly the stored order.
        assert {m["stream"] for m in events} == {"game:chess#g1"}
        assert len({m["epoch"] for m in events}) == 1
        offsets = [m["offset"] for m in events]
        by_offset = [m["payload"]["comment"] for m in sorted(events, key=lambda m: m["offset"])]
        assert by_offset == stored
        assert offsets == sorted(offsets) and len(set(offsets)) == 200
        offsets_by_node.append(offsets)
    assert offsets_by_node[0] == offsets_by_node[1]  # the same positions on both nodes
    # each author's own comments are stored in the order the author sent them
    for player in players:
        mine = [c for c in stored if c.startswith(player + "-")]
        assert mine == [f"{player}-{i}" for i in range(10)]


@pytest.mark.parametrize("chat_cluster", [3], indirect=True)
async def test_the_chat_rate_is_per_user_across_the_cluster(
    chat_cluster: Cluster, raw: Any
) -> None:
    put_game_row(raw, chat_cluster.table, ["alice"])
    on_n1 = await chat_cluster.client("n1", "alice")
    on_n2 = await chat_cluster.client("n2", "alice")
    assert (await post(on_n1, GAME, "a"))["verb"] == "chatAck"
    assert (await post(on_n2, GAME, "b"))["verb"] == "chatAck"
    assert (await post(on_n1, GAME, "c"))["verb"] == "chatAck"
    limited = await post(on_n2, GAME, "d", msg_id="fourth")
    assert limited["payload"]["code"] == "rate_limited"
    assert limited["payload"]["clientMsgId"] == "fourth"
    assert stored_comments(raw, chat_cluster.table) == ["a", "b", "c"]


async def metric(cluster: Cluster, name: str, metric_name: str) -> float:
    async with (
        aiohttp.ClientSession() as session,
        session.get(cluster.nodes[name].http_url + "/metrics") as response,
    ):
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(metric_name + " "):
            return float(line.split()[1])
    return 0.0


async def test_last_seen_is_written_once_across_nodes(chat_cluster: Cluster, raw: Any) -> None:
    key = {"pk": {"S": "USERS"}, "sk": {"S": "alice"}}
    raw.put_item(TableName=chat_cluster.table, Item={**key, "name": {"S": "Alice"}})
    tabs = [await chat_cluster.client(n, "alice") for n in ("n1", "n2", "n1", "n2")]

    def last_seen() -> int | None:
        item = raw.get_item(TableName=chat_cluster.table, Key=key, ConsistentRead=True)["Item"]
        return int(item["lastSeen"]["N"]) if "lastSeen" in item else None

    await eventually(lambda: last_seen() is not None, 5 + SLACK, "the first lastSeen")
    raw.put_item(
        TableName=chat_cluster.table, Item={**key, "name": {"S": "Alice"}, "lastSeen": {"N": "1"}}
    )
    # Seen again on both nodes: a syncPresence on every tab, and a new tab on each node.
    for tab in tabs:
        await tab.sync_presence()
    for name in ("n1", "n2"):
        await chat_cluster.client(name, "alice")
    await asyncio.sleep(1.0)
    assert last_seen() == 1
    writes = [await metric(chat_cluster, n, "ap_last_seen_writes_total") for n in ("n1", "n2")]
    assert sum(writes) == 1
