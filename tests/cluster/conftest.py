"""Fixtures: a fresh Redis, table and three node processes for each test.

``cluster`` runs over the worker's ``redis-server``, emptied for the test (which
may restart it); a module that parametrizes it indirectly with
``"redis-cluster"`` runs the same tests over the worker's six-instance Redis
Cluster (the nodes' keys and channels are namespaced by nothing but the table,
so each test flushes the cluster first).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import pytest

from loadtest.harness.redis_cluster import RedisCluster
from server.store.dynamodb import create_table
from tests.cluster.harness import REGION, Cluster, new_workdir, remove_workdir
from tests.services import RedisServer

NODES = ("n1", "n2", "n3")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[FAILED] = report.failed
    return report


FAILED = pytest.StashKey[bool]()


@contextlib.contextmanager
def redis_for(request: pytest.FixtureRequest) -> Iterator[RedisServer | RedisCluster]:
    """The test's Redis by its parameter: the worker's ``redis-server``, emptied (the
    test may restart it), or the worker's Redis Cluster, emptied."""
    if getattr(request, "param", "redis") == "redis-cluster":
        shared: RedisCluster = request.getfixturevalue("shared_redis_cluster")
        shared.flush()
        yield shared
        return
    redis: RedisServer = request.getfixturevalue("fresh_redis")
    yield redis


@pytest.fixture
async def cluster(request: pytest.FixtureRequest, dynamodb_endpoint: str) -> AsyncIterator[Cluster]:
    """Three started nodes on a Redis emptied for the test (it may restart it)."""
    with redis_for(request) as redis:
        async with nodes_on(redis, request, dynamodb_endpoint, NODES) as running:
            yield running


@pytest.fixture
async def pair(
    request: pytest.FixtureRequest, dynamodb_endpoint: str, fresh_redis: RedisServer
) -> AsyncIterator[Cluster]:
    """A Redis and a table with no node started: the test starts its own (two, say)."""
    async with nodes_on(fresh_redis, request, dynamodb_endpoint, ()) as running:
        yield running


@contextlib.asynccontextmanager
async def nodes_on(
    redis: RedisServer | RedisCluster,
    request: pytest.FixtureRequest,
    dynamodb_endpoint: str,
    names: tuple[str, ...] = NODES,
    *,
    table: str | None = None,
    **overrides: Any,
) -> AsyncIterator[Cluster]:
    """The named nodes, started on ``redis`` with ``overrides`` of their settings, on
    ``table`` or a table of their own; their logs if the test failed."""
    if table is None:
        table = f"cluster-{uuid.uuid4().hex[:12]}"
        await create_table(dynamodb_endpoint, table, REGION)
    workdir = new_workdir()
    running = Cluster(redis, dynamodb_endpoint, table, workdir)
    try:
        await running.start(*names, **overrides)
        yield running
    finally:
        await running.close()
        if request.node.stash.get(FAILED, True) or os.environ.get("AP_CLUSTER_LOGS"):
            print(running.logs())
        remove_workdir(workdir)


BOTH_REDIS = pytest.mark.parametrize("cluster", ["redis", "redis-cluster"], indirect=True)
"""Run a module's tests over one Redis and over a Redis Cluster."""
