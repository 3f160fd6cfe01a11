"""The queue bridge on two node processes: competing consumers, a kill, a Redis restart.

Both nodes poll one moto queue; their clients must see every message exactly once,
while both live and after a kill -9 of one of them.
Competing consumers and the kill run on one Redis and on the session's Redis
Cluster (dedup keys spread over its slots).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import boto3
import pytest
from redis.asyncio.cluster import RedisCluster as ClusterClient

from protocol.messages import game_key
from protocol.streams import game_stream
from server.bus.redis_streams import meta_key
from tests.client import Client
from tests.cluster.conftest import nodes_on, redis_for
from tests.cluster.harness import REGION, Cluster
from tests.services import RedisServer
from tests.waiting import eventually

NODES = ("b1", "b2")


def sqs(endpoint: str) -> Any:
    return boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)


def send_batch(endpoint: str, queue_url: str, bodies: list[dict[str, Any]]) -> None:
    client = sqs(endpoint)
    for start in range(0, len(bodies), 10):
        chunk = bodies[start : start + 10]
        entries = [{"Id": str(i), "MessageBody": json.dumps(b)} for i, b in enumerate(chunk)]
        response = client.send_message_batch(QueueUrl=queue_url, Entries=entries)
        assert not response.get("Failed"), response


def depth(endpoint: str, queue_url: str) -> int:
    attributes = sqs(endpoint).get_queue_attributes(
        QueueUrl=queue_url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]) + int(
        attributes["ApproximateNumberOfMessagesNotVisible"]
    )


def moves(first: int, count: int) -> list[dict[str, Any]]:
    return [
        {"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": n}}
        for n in range(first, first + count)
    ]


async def watcher_on(cluster: Cluster, node: str, user: str) -> Client:
    """A stream speaker watching chess#g1: once its ``since`` is answered (the
    barrier), its node hears the game's live events, so none can pass it by."""
    client = await cluster.client(node, user, games=[("chess", "g1")], since={})
    await client.barrier()
    return client


ARRIVAL_S = 120.0
"""How long the queue's messages may take to reach the watchers and leave the queue.
Each is a bound on waiting, not a speed: on a loaded machine (moto shared with
the other workers, the chaos soak beside) 200 messages once took over 30 s. A
message lost never arrives, so a longer wait costs only a failing run its time."""


def seen(client: Client) -> list[int]:
    return [m["payload"]["n"] for m in client.of_verb("game")]


STREAM = game_stream(game_key("chess", "g1"))

NODE_FIGURES = (
    "ap_sqs_messages_received_total",
    "ap_sqs_messages_published_total",
    "ap_sqs_duplicates_total",
    "ap_sqs_messages_returned_total",
    "ap_sqs_errors_total",
    "ap_sqs_messages_in_flight",
    "ap_bus_messages_total",
    "ap_bus_reconnects_total",
    "ap_stream_delivered_at_append_total",
    "ap_stream_gaps_total",
    "ap_stream_repaired_events_total",
    "ap_stream_losses_total",
    "ap_stream_audit_missed_total",
)


async def all_seen(
    cluster: Cluster, queue_url: str, watchers: list[Client], count: int, what: str
) -> None:
    """Every watcher has seen ``count`` events; on a timeout, where each one stopped."""
    try:
        for watcher in watchers:
            await eventually(lambda w=watcher: len(seen(w)) >= count, ARRIVAL_S, what)  # type: ignore[misc]
    except AssertionError as exc:
        report = await where_it_stopped(cluster, queue_url, watchers, count)
        raise AssertionError(f"{exc}\n{report}") from None


async def where_it_stopped(
    cluster: Cluster, queue_url: str, watchers: list[Client], count: int
) -> str:
    """What a failed wait needs to say: which events each watcher lacks, how far the
    stream got in Redis, what the queue still holds, and each live node's counts (a
    message never published, or published and not delivered, reads differently)."""
    lines = []
    for index, watcher in enumerate(watchers):
        numbers = seen(watcher)
        missing = sorted(set(range(count)) - set(numbers))
        lines.append(
            f"watcher {index}: {len(numbers)} events, {len(numbers) - len(set(numbers))} "
            f"repeated, missing {missing[:20]}{' ...' if len(missing) > 20 else ''}; "
            f"recovered {watcher.recovered(STREAM)}; close code {watcher.ws.close_code}; "
            f"reader {watcher.reader_state}"
        )
    client = cluster.redis_client()
    try:
        lines.append(f"stream {STREAM} in Redis: {await client.hgetall(meta_key(STREAM))}")
    except Exception as exc:
        lines.append(f"stream {STREAM} unreadable: {exc!r}")
    finally:
        await client.aclose()
    try:
        queued = await asyncio.to_thread(depth, cluster.dynamodb_endpoint, queue_url)
        lines.append(f"queue: {queued} messages left")
    except Exception as exc:
        lines.append(f"queue unreadable: {exc!r}")
    for name, node in cluster.nodes.items():
        if not node.alive:
            lines.append(f"{name}: not running")
            continue
        try:
            figures = {m: await cluster.metric(name, m) for m in NODE_FIGURES}
        except Exception as exc:
            lines.append(f"{name}: metrics unreadable: {exc!r}")
        else:
            lines.append(f"{name}: " + ", ".join(f"{m} {v:g}" for m, v in figures.items()))
    return "\n".join(lines)


async def drained(cluster: Cluster, queue_url: str, within: float) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while await asyncio.to_thread(depth, cluster.dynamodb_endpoint, queue_url) != 0:
        assert asyncio.get_running_loop().time() < deadline, "the queue was not drained"
        await asyncio.sleep(0.2)


@pytest.fixture
async def bridged(
    request: pytest.FixtureRequest, dynamodb_endpoint: str
) -> AsyncIterator[tuple[Cluster, str]]:
    queue_url: str = sqs(dynamodb_endpoint).create_queue(
        QueueName=f"ws-messages-{uuid.uuid4().hex[:10]}", Attributes={"VisibilityTimeout": "900"}
    )["QueueUrl"]
    with redis_for(request) as redis:
        async with nodes_on(
            redis,
            request,
            dynamodb_endpoint,
            NODES,
            sqs_queue_url=queue_url,
            sqs_endpoint=dynamodb_endpoint,
            sqs_wait_seconds=1,
            sqs_visibility_seconds=3,
            sqs_pollers=2,
        ) as cluster:
            yield cluster, queue_url


ON_BOTH = pytest.mark.parametrize("bridged", ["redis", "redis-cluster"], indirect=True)


@ON_BOTH
async def test_competing_consumers_deliver_each_message_once(
    bridged: tuple[Cluster, str],
) -> None:
    cluster, queue_url = bridged
    watchers = [await watcher_on(cluster, name, f"w-{name}") for name in NODES]
    await asyncio.to_thread(send_batch, cluster.dynamodb_endpoint, queue_url, moves(0, 200))
    await all_seen(cluster, queue_url, watchers, 200, "200 events")
    await drained(cluster, queue_url, ARRIVAL_S)
    await asyncio.sleep(1)  # room for a duplicate to show up
    for watcher in watchers:
        assert sorted(seen(watcher)) == list(range(200))
    logs = cluster.logs()
    assert "queue bridge on" in logs
    assert await done_marks(cluster) == 200  # shared by both nodes, in Redis


async def done_marks(cluster: Cluster) -> int:
    """Published MessageIds remembered in Redis (on every primary of a Redis Cluster)."""
    client = cluster.redis_client()
    try:
        if isinstance(client, ClusterClient):
            keys = await client.keys("ap:sqs:*", target_nodes=ClusterClient.PRIMARIES)
        else:
            keys = await client.keys("ap:sqs:*")
        return len(keys)
    finally:
        await client.aclose()


@ON_BOTH
async def test_a_node_killed_mid_run_loses_and_duplicates_nothing(
    bridged: tuple[Cluster, str],
) -> None:
    cluster, queue_url = bridged
    watcher = await watcher_on(cluster, "b2", "survivor")
    await watcher_on(cluster, "b1", "doomed")
    sender = asyncio.create_task(
        asyncio.to_thread(send_batch, cluster.dynamodb_endpoint, queue_url, moves(0, 300))
    )
    await eventually(lambda: len(seen(watcher)) >= 50, ARRIVAL_S, "the first events")
    cluster.kill("b1")  # with messages received and not yet deleted, most likely
    await sender
    # What b1 held comes back after the visibility timeout (3 s) and b2 takes it.
    await all_seen(cluster, queue_url, [watcher], 300, "all 300 events")
    await drained(cluster, queue_url, ARRIVAL_S)
    await asyncio.sleep(1)
    # Nothing lost, nothing twice: a batch b1 published but never marked done is
    # published again by b2 after its claim lapses, and the streams' event ids
    # (the MessageIds) turn each repeat into the position it already has.
    assert sorted(seen(watcher)) == list(range(300))


async def test_a_redis_restart_keeps_messages_in_the_queue_until_published(
    bridged: tuple[Cluster, str],
) -> None:
    cluster, queue_url = bridged
    assert isinstance(cluster.redis, RedisServer)  # one Redis, restarted empty
    watchers = [await cluster.client(name, f"w-{name}", games=[("chess", "g1")]) for name in NODES]
    await asyncio.to_thread(send_batch, cluster.dynamodb_endpoint, queue_url, moves(0, 20))
    await all_seen(cluster, queue_url, watchers, 20, "the first 20")
    # Seen is not yet deleted: a batch whose appends landed but whose answers the stop
    # cuts off is handed back, and once Redis returns without its id keys it would be
    # appended again (the one window operations.md names). This test is about the
    # messages sent during the outage, so the first 20 are done before Redis stops.
    await drained(cluster, queue_url, ARRIVAL_S)
    cluster.redis.stop()
    await asyncio.to_thread(send_batch, cluster.dynamodb_endpoint, queue_url, moves(20, 40))
    await asyncio.sleep(2)
    assert await asyncio.to_thread(depth, cluster.dynamodb_endpoint, queue_url) > 0
    cluster.redis.restart()
    await all_seen(cluster, queue_url, watchers, 60, "all 60")
    await drained(cluster, queue_url, ARRIVAL_S)
    await asyncio.sleep(1)
    for watcher in watchers:
        assert watcher.ws.close_code is None  # connected through the outage
        assert sorted(seen(watcher)) == list(range(60))
