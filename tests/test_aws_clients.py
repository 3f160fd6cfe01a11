"""Every AWS client of a node, and ``seed-bot``'s, sends the fixed ``User-Agent``
(``server/aws.py``).

Seen from outside: a node whose store, notification stream and SQS bridge all
talk to moto through ``DynamoFaultProxy``, which records each request's header.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from server import __version__
from server.dev_bot import seed_dynamodb
from tests.conftest import TEST_SETTINGS, new_table, run_server
from tests.queues import new_queue
from tests.services import DynamoFaultProxy
from tests.test_notifications import reading
from tests.test_table_stream import enable_stream
from tests.waiting import eventually


async def test_the_store_the_stream_reader_and_the_sqs_bridge_send_the_node_user_agent(
    dynamodb_endpoint: str, dynamodb_proxy: DynamoFaultProxy, raw: Any
) -> None:
    table = await new_table(dynamodb_endpoint)
    enable_stream(raw, table)
    queue = new_queue(dynamodb_endpoint, "user-agent")
    proxy = dynamodb_proxy
    settings = dataclasses.replace(
        TEST_SETTINGS,
        store="dynamodb",
        dynamodb_endpoint=proxy.endpoint,
        table=table,
        notifications_from_stream=True,
        stream_poll_ms=200,
        sqs_queue_url=queue,
        sqs_endpoint=proxy.endpoint,
        sqs_wait_seconds=1,
        sqs_pollers=1,
    )
    async with run_server(settings) as running:
        await reading(running)
        await running.subscribed("alice")  # its wsConnections row, written behind
        await eventually(
            lambda: {"BatchWriteItem", "ReceiveMessage", "GetRecords"} <= set(proxy.operations),
            30,
            "a connection row written, the queue polled and the stream read",
        )
    (agent,) = proxy.user_agents  # one for every request of every client
    assert agent.startswith(f"ap-realtime/{__version__} "), agent
    # Not the one botocore assembles afresh for each request.
    assert "ua/" not in agent and "lang/python" not in agent, agent


async def test_seed_bot_sends_the_same_user_agent(
    dynamodb_endpoint: str, dynamodb_proxy: DynamoFaultProxy
) -> None:
    """``ap-realtime seed-bot`` writes to the same table: its requests carry the
    header too, so one CloudTrail filter finds everything this project sent."""
    table = await new_table(dynamodb_endpoint)
    proxy = dynamodb_proxy
    meta, game = await seed_dynamodb(proxy.endpoint, table, "us-east-1", "ua-bot")
    assert (meta, game) == ("chess", "dev-game-ua-bot")
    assert set(proxy.operations) == {"PutItem"}
    (agent,) = proxy.user_agents
    assert agent.startswith(f"ap-realtime/{__version__} "), agent
