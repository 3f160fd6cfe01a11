"""Fixtures for the Store contract: a fresh store per test (moto comes from tests/conftest)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from server.store import MemoryStore, Store
from server.store.dynamodb import DynamoStore, create_table

REGION = "us-east-1"


@pytest.fixture(params=["memory", "dynamodb"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """A started, empty store; for DynamoDB a table of its own, so tests are isolated."""
    impl: Store
    if request.param == "memory":
        impl = MemoryStore()
    else:
        endpoint: str = request.getfixturevalue("dynamodb_endpoint")
        table = f"contract-{uuid.uuid4().hex[:12]}"
        await create_table(endpoint, table, REGION)
        impl = DynamoStore(table=table, region=REGION, endpoint_url=endpoint)
    await impl.start()
    try:
        yield impl
    finally:
        await impl.close()
