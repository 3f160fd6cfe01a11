"""The notification push on two node processes: one reader, and a handover after kill -9
(on one Redis and on the session's Redis Cluster)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import boto3
import pytest

from server.ingress.notifications import LEASE_KEY
from server.store.dynamodb import create_table
from tests.client import Client
from tests.cluster.conftest import nodes_on, redis_for
from tests.cluster.harness import REGION, Cluster
from tests.test_table_stream import enable_stream, put_notification
from tests.waiting import eventually

NODES = ("p1", "p2")
LEADER_KEY = LEASE_KEY


def numbers(client: Client) -> list[int]:
    return [m["payload"]["body"]["n"] for m in client.of_verb("notification")]


async def reader_node(cluster: Cluster) -> str | None:
    client = cluster.redis_client()
    try:
        token = await client.get(LEADER_KEY)
    finally:
        await client.aclose()
    if token is None:
        return None
    text = token.decode() if isinstance(token, bytes) else str(token)
    return text.split("/", 1)[0]


@pytest.fixture
async def pushing(
    request: pytest.FixtureRequest, dynamodb_endpoint: str
) -> AsyncIterator[tuple[Cluster, Any]]:
    table = f"notif-{uuid.uuid4().hex[:12]}"
    await create_table(dynamodb_endpoint, table, REGION)
    raw = boto3.client("dynamodb", endpoint_url=dynamodb_endpoint, region_name=REGION)
    enable_stream(raw, table)
    with redis_for(request) as redis:
        async with nodes_on(
            redis,
            request,
            dynamodb_endpoint,
            NODES,
            table=table,
            notifications_from_stream="true",
            stream_poll_ms=200,
        ) as cluster:
            yield cluster, raw


@pytest.mark.parametrize("pushing", ["redis", "redis-cluster"], indirect=True)
async def test_a_handover_after_kill_9_pushes_each_notification_once(
    pushing: tuple[Cluster, Any],
) -> None:
    cluster, raw = pushing
    reader = None
    for _ in range(300):
        reader = await reader_node(cluster)
        if reader is not None and "reading shard" in cluster.nodes[reader].log():
            break  # its LATEST iterator is taken: rows from now on are read
        await asyncio.sleep(0.1)
    assert reader in NODES
    survivor = next(name for name in NODES if name != reader)
    tabs = {name: await cluster.client(name, "alice", since={}) for name in NODES}
    for n in range(5):
        put_notification(raw, cluster.table, "alice", n)
    for tab in tabs.values():
        await eventually(lambda t=tab: len(numbers(t)) >= 5, 15, "the first five")  # type: ignore[misc]
    cluster.kill(reader)
    for n in range(5, 10):
        put_notification(raw, cluster.table, "alice", n)
    tab = tabs[survivor]
    await eventually(lambda: len(numbers(tab)) >= 10, 30, "the five written after the kill")
    await asyncio.sleep(1.5)  # room for a duplicate to show up
    assert numbers(tab) == list(range(10))
    offsets = [m["offset"] for m in tab.of_verb("notification")]
    assert offsets == list(range(1, 11))
    assert await reader_node(cluster) == survivor
    assert "reading" in cluster.nodes[survivor].log()
