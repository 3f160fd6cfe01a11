"""Fixtures: a fresh Redis, table and three node processes for each test."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Generator

import pytest

from server.store.dynamodb import create_table
from tests.cluster.harness import REGION, Cluster, new_workdir, remove_workdir
from tests.services import start_redis_server

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


@pytest.fixture
async def cluster(request: pytest.FixtureRequest, dynamodb_endpoint: str) -> AsyncIterator[Cluster]:
    """Three started nodes on one Redis of the test's own (it may restart it)."""
    async with running_cluster(request, dynamodb_endpoint, NODES) as running:
        yield running


@pytest.fixture
async def pair(request: pytest.FixtureRequest, dynamodb_endpoint: str) -> AsyncIterator[Cluster]:
    """A Redis and a table with no node started: the test starts its own (two, say)."""
    async with running_cluster(request, dynamodb_endpoint, ()) as running:
        yield running


@contextlib.asynccontextmanager
async def running_cluster(
    request: pytest.FixtureRequest, dynamodb_endpoint: str, names: tuple[str, ...]
) -> AsyncIterator[Cluster]:
    redis = start_redis_server()
    table = f"cluster-{uuid.uuid4().hex[:12]}"
    await create_table(dynamodb_endpoint, table, REGION)
    workdir = new_workdir()
    running = Cluster(redis, dynamodb_endpoint, table, workdir)
    try:
        await running.start(*names)
        yield running
    finally:
        await running.close()
        if request.node.stash.get(FAILED, True) or os.environ.get("AP_CLUSTER_LOGS"):
            print(running.logs())
        redis.stop()
        remove_workdir(workdir)
