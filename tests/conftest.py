"""Fixtures: a real node on 127.0.0.1 with real sockets, embedded default."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest

from loadtest.harness.redis_cluster import RedisCluster, redis_cluster_for_tests
from server.app import bound_port, start_listeners
from server.config import Settings
from server.node import Node
from server.store.base import Store
from server.store.dynamodb import create_table
from server.wiring import build_node
from tests.client import DEV_SECRET, Client
from tests.services import dynamodb_endpoint_for_tests

PUBLISH_SECRET = "publish-secret-for-tests"
TEST_REGION = "us-east-1"

TEST_SETTINGS = Settings(
    port=0,
    http_port=0,
    node_id="test-node",
    dev_jwt_secret=DEV_SECRET,
    publish_secret=PUBLISH_SECRET,
    presence_debounce_ms=150,
)


@dataclass
class RunningServer:
    node: Node
    ws_url: str
    http_url: str
    clients: list[Client]

    async def client(self, **kwargs: Any) -> Client:
        client = await Client.open(self.ws_url, **kwargs)
        self.clients.append(client)
        return client

    async def subscribed(self, user_id: str, **kwargs: Any) -> Client:
        client = await self.client()
        await client.subscribe(user_id, **kwargs)
        return client

    async def http(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        secret: str | None = PUBLISH_SECRET,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any] | str]:
        """One request to the internal HTTP listener, off the event loop."""
        import asyncio

        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        request = urllib.request.Request(self.http_url + path, data=data, method=method)
        if secret is not None:
            request.add_header("Authorization", f"Bearer {secret}")
        for name, value in (headers or {}).items():
            request.add_header(name, value)

        def call() -> tuple[int, dict[str, Any] | str]:
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    status, text = response.status, response.read().decode()
            except urllib.error.HTTPError as error:
                status, text = error.code, error.read().decode()
            try:
                return status, json.loads(text)
            except ValueError:
                return status, text

        return await asyncio.to_thread(call)

    async def publish(self, body: Any, **kwargs: Any) -> tuple[int, dict[str, Any] | str]:
        return await self.http("POST", "/publish", body, **kwargs)


@contextlib.asynccontextmanager
async def run_server(
    settings: Settings, store: Store | None = None
) -> AsyncIterator[RunningServer]:
    node = await build_node(settings, store)
    await node.start()
    ws_server, runner = await start_listeners(node)
    http_port = runner.addresses[0][1]
    running = RunningServer(
        node=node,
        ws_url=f"ws://127.0.0.1:{bound_port(ws_server)}/",
        http_url=f"http://127.0.0.1:{http_port}",
        clients=[],
    )
    try:
        yield running
    finally:
        for client in running.clients:
            await client.close()
        ws_server.close(close_connections=False)
        await node.stop()
        await ws_server.wait_closed()
        await runner.cleanup()


@pytest.fixture(scope="session")
def dynamodb_endpoint() -> Iterator[str]:
    """A DynamoDB endpoint: ``AP_TEST_DYNAMODB_ENDPOINT`` or a moto server for the session."""
    with dynamodb_endpoint_for_tests() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def shared_redis_cluster() -> Iterator[RedisCluster]:
    """One six-instance Redis Cluster for the session's non-destructive tests.

    Tests that kill or restart instances start a cluster of their own.
    """
    with redis_cluster_for_tests() as cluster:
        yield cluster


async def new_table(endpoint: str) -> str:
    """Create a fresh table (TTL on), so DynamoDB tests never see each other's rows."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    await create_table(endpoint, name, TEST_REGION)
    return name


@pytest.fixture
async def table(dynamodb_endpoint: str) -> str:
    return await new_table(dynamodb_endpoint)


@pytest.fixture
def raw(dynamodb_endpoint: str) -> Any:
    """A plain, synchronous boto3 client: reads the table the way the backend does."""
    return boto3.client("dynamodb", endpoint_url=dynamodb_endpoint, region_name=TEST_REGION)


@pytest.fixture
async def server(request: pytest.FixtureRequest) -> AsyncIterator[RunningServer]:
    overrides = getattr(request, "param", {})
    async with run_server(dataclasses.replace(TEST_SETTINGS, **overrides)) as running:
        yield running
