"""Fixtures for the Store contract: a fresh store per test (moto comes from tests/conftest)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from server.store import MemoryStore, Store
from server.store.dynamodb import DynamoStore
from tests.conftest import TEST_REGION, new_table

REGION = TEST_REGION


@pytest.fixture(params=["memory", "dynamodb"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """A started, empty store; for DynamoDB a table of its own, so tests are isolated."""
    impl: Store
    if request.param == "memory":
        impl = MemoryStore()
    else:
        endpoint: str = request.getfixturevalue("dynamodb_endpoint")
        table = await new_table(endpoint)
        impl = DynamoStore(table=table, region=REGION, endpoint_url=endpoint)
    await impl.start()
    try:
        yield impl
    finally:
        await impl.close()
