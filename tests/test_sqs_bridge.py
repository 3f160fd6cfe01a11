"""The queue bridge on one node: today's queue body in, frames out, over real sockets.

SQS is a moto server over HTTP (the session's ``dynamodb_endpoint`` serves every
service), sent to with plain boto3 the way the live backend sends; faults come
from a proxy in front of it. The cluster cases are in ``tests/cluster``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from loadtest.harness.faults import TcpFaultProxy
from server.coordination.dedup import RedisDedup
from server.ingress import queue_core
from server.ingress.queue_core import QueuePolling
from server.ingress.sqs import DEDUP_PREFIX, SqsBridge
from server.redis.client import make_client
from tests.client import Client
from tests.conftest import TEST_REGION, TEST_SETTINGS, RunningServer, new_table, run_server
from tests.queues import depth, new_queue, send, sqs_client
from tests.services import DynamoFaultProxy, RedisServer
from tests.waiting import eventually_in_thread


def new_live_queue(endpoint: str) -> str:
    """A queue shaped like the live one: standard, 900 s visibility, 1 day retention."""
    return new_queue(endpoint, "abstractplay-ws-messages-test", visibility=900)


def game_events(client: Client) -> list[dict[str, Any]]:
    return [m["payload"] for m in client.messages if m.get("verb") in ("game", "chat")]


def bridge_of(running: RunningServer, redis_url: str, endpoint: str, queue: str) -> SqsBridge:
    """A second bridge on ``running``'s node, one poller, its claims on ``redis_url``."""
    return SqsBridge(
        running.node.publish,
        running.node.bus,
        RedisDedup(make_client(redis_url, retries=1)),
        QueuePolling(
            queue,
            node_id=running.node.node_id,
            region=TEST_REGION,
            endpoint_url=endpoint,
            pollers=1,
            wait_seconds=1,
            visibility_seconds=2,
        ),
        metrics=running.node.metrics,
    )


@pytest.fixture
def queue(dynamodb_endpoint: str) -> str:
    return new_live_queue(dynamodb_endpoint)


@pytest.fixture
async def bridged(dynamodb_endpoint: str, queue: str) -> AsyncIterator[RunningServer]:
    settings = dataclasses.replace(
        TEST_SETTINGS,
        sqs_queue_url=queue,
        sqs_endpoint=dynamodb_endpoint,
        sqs_wait_seconds=1,
        sqs_visibility_seconds=2,
        sqs_pollers=2,
    )
    async with run_server(settings) as running:
        yield running


async def test_todays_exact_body_reaches_the_watchers_and_exclude_holds(
    bridged: RunningServer, dynamodb_endpoint: str, queue: str
) -> None:
    mover = await bridged.subscribed("alice", games=[("chess", "g1")])
    opponent = await bridged.subscribed("bob", games=[("chess", "g1")])
    elsewhere = await bridged.subscribed("carol", games=[("go", "g2")])
    legacy = await bridged.subscribed("dave", watch_version=None)
    # submitMove's body, byte for byte, plus the older version's extra fields.
    body = {
        "verb": "game",
        "payload": {"meta": "chess", "id": "g1"},
        "exclude": ["alice"],
        "domainName": "abc123.execute-api.us-east-1.amazonaws.com",
        "stage": "prod",
    }
    await asyncio.to_thread(send, dynamodb_endpoint, queue, body)
    event = await opponent.next_message(lambda m: m.get("verb") == "game", within=10)
    assert (event["verb"], event["payload"]) == ("game", {"meta": "chess", "id": "g1"})
    assert (event["stream"], event["offset"]) == ("game:chess#g1", 1)
    await legacy.next_message(lambda m: m.get("verb") == "game", within=10)
    # invokePie's comment: exclude [""] excludes nobody real.
    pie = {"verb": "game", "payload": {"meta": "chess", "id": "g1"}, "exclude": [""]}
    await asyncio.to_thread(send, dynamodb_endpoint, queue, pie)
    await mover.next_message(lambda m: m.get("verb") == "game", within=10)
    await eventually_in_thread(lambda: depth(dynamodb_endpoint, queue) == 0, 10, "an empty queue")
    for client in (mover, opponent, elsewhere, legacy):
        await client.barrier()
    assert len(game_events(opponent)) == 2
    assert len(game_events(legacy)) == 2
    assert len(game_events(mover)) == 1  # excluded from its own move, not from the pie line
    assert game_events(elsewhere) == []


async def test_a_poison_message_is_deleted_and_counted_and_the_rest_flows(
    bridged: RunningServer, dynamodb_endpoint: str, queue: str
) -> None:
    watcher = await bridged.subscribed("bob", games=[("chess", "g1")])
    metrics = bridged.node.metrics
    before = metrics.value("ap_sqs_poison_messages_total")
    for body in (
        "this is not JSON",
        {"verb": "move", "payload": {"meta": "chess", "id": "g1"}},  # unknown verb
        {"verb": "game", "payload": {"meta": "chess"}},  # no id
    ):
        await asyncio.to_thread(send, dynamodb_endpoint, queue, body)
    await asyncio.to_thread(
        send, dynamodb_endpoint, queue, {"verb": "game", "payload": {"meta": "chess", "id": "g1"}}
    )
    await watcher.next_message(lambda m: m.get("verb") == "game", within=10)
    await eventually_in_thread(lambda: depth(dynamodb_endpoint, queue) == 0, 10, "an empty queue")
    # Each poison message at least once: one whose visibility ran out before its
    # delete (a loaded machine) comes again and is counted again, then deleted.
    assert metrics.value("ap_sqs_poison_messages_total") - before >= 3
    assert len(game_events(watcher)) == 1


async def test_a_message_delivered_again_reaches_each_client_once(
    dynamodb_endpoint: str, dynamodb_proxy: DynamoFaultProxy, queue: str
) -> None:
    """The delete fails, so SQS delivers the published message again: it is not re-sent."""
    proxy = dynamodb_proxy
    settings = dataclasses.replace(
        TEST_SETTINGS,
        sqs_queue_url=queue,
        sqs_endpoint=proxy.endpoint,
        sqs_wait_seconds=1,
        sqs_visibility_seconds=1,
        sqs_pollers=1,
    )
    async with run_server(settings) as running:
        watcher = await running.subscribed("bob", games=[("chess", "g1")])
        duplicates = running.node.metrics.value("ap_sqs_duplicates_total")
        proxy.fail_operation("DeleteMessageBatch", 3)  # every attempt of the first delete
        body = {"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": 1}}
        await asyncio.to_thread(send, dynamodb_endpoint, queue, body)
        await eventually_in_thread(
            lambda: depth(dynamodb_endpoint, queue) == 0, 15, "the redelivery deleted"
        )
        assert running.node.metrics.value("ap_sqs_duplicates_total") - duplicates == 1
        await watcher.barrier()
        assert game_events(watcher) == [{"meta": "chess", "id": "g1", "n": 1}]
        assert proxy.count("DeleteMessageBatch") >= 4


async def test_sqs_down_then_back_loses_nothing(
    dynamodb_endpoint: str, dynamodb_proxy: DynamoFaultProxy, queue: str
) -> None:
    proxy = dynamodb_proxy
    settings = dataclasses.replace(
        TEST_SETTINGS,
        sqs_queue_url=queue,
        sqs_endpoint=proxy.endpoint,
        sqs_wait_seconds=1,
        sqs_visibility_seconds=2,
        sqs_pollers=2,
    )
    async with run_server(settings) as running:
        watcher = await running.subscribed("bob", games=[("chess", "g1")])
        metrics = running.node.metrics
        errors = metrics.value("ap_sqs_errors_total")
        proxy.fail_all("ServiceUnavailable", 503)
        await asyncio.sleep(1.5)  # long polls already inside moto end first
        for n in range(20):
            body = {"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": n}}
            await asyncio.to_thread(send, dynamodb_endpoint, queue, body)
        await asyncio.sleep(1.5)
        assert running.node.metrics.value("ap_sqs_errors_total") > errors  # it did try, and failed
        assert game_events(watcher) == []
        assert running.node.ready  # clients stay connected meanwhile
        proxy.recover()
        await eventually_in_thread(lambda: len(game_events(watcher)) >= 20, 20, "all 20 events")
        await eventually_in_thread(lambda: depth(dynamodb_endpoint, queue) == 0, 10, "empty")
        await watcher.barrier()
        assert sorted(e["n"] for e in game_events(watcher)) == list(range(20))


async def test_without_the_flag_nothing_polls_aws(server: RunningServer) -> None:
    assert server.node.services == []


async def test_a_user_event_in_the_queue_reaches_every_tab_of_its_user(
    bridged: RunningServer, dynamodb_endpoint: str, queue: str
) -> None:
    tabs = [await bridged.subscribed("bot1") for _ in range(2)]
    other = await bridged.subscribed("human")
    body = {"verb": "yourTurn", "payload": {"meta": "chess", "id": "g1"}, "users": ["bot1"]}
    await asyncio.to_thread(send, dynamodb_endpoint, queue, body)
    for tab in tabs:
        frame = await tab.next_message(lambda m: m.get("verb") == "yourTurn", within=10)
        assert frame["payload"] == {"meta": "chess", "id": "g1"}
        assert (frame["stream"], frame["offset"]) == ("user:bot1", 1)
    await other.barrier()
    assert other.of_verb("yourTurn") == []


async def test_one_message_handed_to_two_pollers_of_one_node_is_published_once(
    dynamodb_endpoint: str, queue: str, fresh_redis: RedisServer
) -> None:
    """SQS (and moto, whose receive is not atomic across threads) may give one message to
    two concurrent receives; both are this node's pollers, and one publish must come of it.
    With Redis the claim and the publish really interleave."""
    from server.ingress.sqs import _Received

    settings = dataclasses.replace(
        TEST_SETTINGS,
        sqs_queue_url=queue,
        sqs_endpoint=dynamodb_endpoint,
        sqs_wait_seconds=1,
        store="dynamodb",
        dynamodb_endpoint=dynamodb_endpoint,
        table=await new_table(dynamodb_endpoint),
    )
    redis_url = fresh_redis.url  # nodes: the worker's own Redis (fixed channels)
    async with run_server(dataclasses.replace(settings, redis_url=redis_url)) as running:
        # Found by type: a cluster node runs other services too (the stream audit).
        (bridge,) = [s for s in running.node.services if isinstance(s, SqsBridge)]
        watcher = await running.subscribed("bob", games=[("chess", "g1")])
        body = json.dumps({"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": 9}})
        message_id = str(uuid.uuid4())
        copies = [_Received(message_id, f"receipt-{i}", body, None) for i in range(2)]
        await asyncio.gather(*(bridge._handle([copy]) for copy in copies))
        await watcher.next_message(lambda m: m.get("verb") == "game", within=10)
        await asyncio.sleep(0.5)
        await watcher.barrier()
        assert game_events(watcher) == [{"meta": "chess", "id": "g1", "n": 9}]


async def test_a_consumer_killed_between_publish_and_complete_costs_no_duplicate(
    dynamodb_endpoint: str, queue: str, fresh_redis: RedisServer
) -> None:
    """The kill window: a consumer claims and publishes, then dies (no complete, no
    delete). Its claim expires, the message comes back and the bridge publishes it
    again: the append remembers the MessageId, so clients get each event once."""
    from protocol.parse import parse_broadcast
    from server.coordination.dedup import Claim

    # Names of this test's own: the offsets asserted below count from the stream's
    # first event.
    tag = uuid.uuid4().hex[:8]
    game, stream, users = f"g-{tag}", f"game:chess#g-{tag}", (f"b1-{tag}", f"b2-{tag}")
    move = {"verb": "game", "payload": {"meta": "chess", "id": game, "n": 1}}
    turn = {"verb": "yourTurn", "payload": {"meta": "chess", "id": game}, "users": list(users)}
    redis_url = fresh_redis.url  # nodes: the worker's own Redis (fixed channels)
    settings = dataclasses.replace(TEST_SETTINGS, redis_url=redis_url)
    async with run_server(settings) as running:
        watcher = await running.subscribed("bob", games=[("chess", game)], since={})
        bots = [await running.subscribed(user, since={}) for user in users]
        for body in (move, turn):
            await asyncio.to_thread(send, dynamodb_endpoint, queue, body)
        # The doomed consumer: receive, claim, publish, and die right there.
        received = await asyncio.to_thread(
            sqs_client(dynamodb_endpoint).receive_message,
            QueueUrl=queue,
            MaxNumberOfMessages=10,
            VisibilityTimeout=1,
        )
        messages = received["Messages"]
        assert len(messages) == 2
        doomed = RedisDedup(make_client(redis_url, retries=1))
        keys = [DEDUP_PREFIX + m["MessageId"] for m in messages]
        assert await doomed.claim(keys, "doomed/1", 1.0) == [Claim.CLAIMED] * 2
        for message in messages:
            await running.node.publish(
                parse_broadcast(message["Body"]),
                require_cluster=True,
                event_id=message["MessageId"],
            )
        await doomed.close()
        await asyncio.sleep(1.2)  # visibility and claim both expired: the kill window
        bridge = bridge_of(running, redis_url, dynamodb_endpoint, queue)
        published = running.node.metrics.value("ap_sqs_messages_published_total")
        await bridge.start()
        try:
            await eventually_in_thread(lambda: depth(dynamodb_endpoint, queue) == 0, 15, "empty")
        finally:
            await bridge.stop()
        # The second consumer did publish both again...
        assert running.node.metrics.value("ap_sqs_messages_published_total") - published == 2
        status, reply = await running.publish(
            {"verb": "game", "payload": {"meta": "chess", "id": game, "n": 2}}
        )
        assert status == 202 and isinstance(reply, dict)
        # ...and neither took a second position, nor reached anyone twice.
        assert reply["positions"][stream]["offset"] == 2
        await watcher.wait_for(lambda: len(watcher.on_stream(stream)) >= 2)
        for client in (watcher, *bots):
            await client.barrier()
        assert [e["n"] for e in game_events(watcher)] == [1, 2]
        assert watcher.offsets(stream) == [1, 2]
        for bot, user in zip(bots, users, strict=True):
            assert len(bot.of_verb("yourTurn")) == 1
            assert bot.offsets(f"user:{user}") == [1]


async def test_a_slow_batch_is_logged_with_where_its_time_went(
    bridged: RunningServer,
    dynamodb_endpoint: str,
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator whose queue lags can tell the store, Redis and SQS apart."""
    monkeypatch.setattr(queue_core, "SLOW_BATCH_SECONDS", 0.0)  # every batch is "slow"
    watcher = await bridged.subscribed("bob", games=[("chess", "g1")])
    with caplog.at_level(logging.WARNING, logger="server.ingress.queue_core"):
        await asyncio.to_thread(
            send,
            dynamodb_endpoint,
            queue,
            {"verb": "game", "payload": {"meta": "chess", "id": "g1"}},
        )
        await watcher.next_message(lambda m: m.get("verb") == "game", within=10)
        await eventually_in_thread(
            lambda: "a batch of 1 took" in caplog.text, 10, "the slow batch's line"
        )
    line = next(r.getMessage() for r in caplog.records if "a batch of 1 took" in r.getMessage())
    for step in ("claim", "prepare", "deliver", "mark", "delete", "its oldest message was queued"):
        assert step in line, line


async def test_a_dedup_store_that_fails_hands_the_batch_back_and_nothing_is_lost(
    dynamodb_endpoint: str, queue: str, fresh_redis: RedisServer, redis_proxy: TcpFaultProxy
) -> None:
    """The bus is up, the claims' Redis is not: both tries at the batch's claims are
    cut. Nothing is delivered unclaimed; the batch goes back to the queue, and comes
    round again once the claims go through: each event reaches the watcher once."""

    game = f"g-{uuid.uuid4().hex[:8]}"
    settings = dataclasses.replace(TEST_SETTINGS, redis_url=fresh_redis.url)
    async with run_server(settings) as running:
        watcher = await running.subscribed("bob", games=[("chess", game)])
        for n in range(3):
            body = {"verb": "game", "payload": {"meta": "chess", "id": game, "n": n}}
            await asyncio.to_thread(send, dynamodb_endpoint, queue, body)
        metrics = running.node.metrics
        redis_proxy.cut_before(DEDUP_PREFIX.encode(), 2)  # the claims and redis-py's retry
        bridge = bridge_of(running, redis_proxy.url, dynamodb_endpoint, queue)
        await bridge.start()
        try:
            await eventually_in_thread(lambda: depth(dynamodb_endpoint, queue) == 0, 60, "empty")
        finally:
            await bridge.stop()
        assert redis_proxy.cuts_before_write == 2
        assert metrics.value("ap_sqs_errors_total") >= 1  # the bridge's own counters
        assert metrics.value("ap_sqs_messages_returned_total") >= 1
        await watcher.barrier()
        assert [e["n"] for e in game_events(watcher)] == [0, 1, 2]
