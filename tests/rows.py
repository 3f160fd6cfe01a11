"""Seed and read the game-side rows of either store, the way the backend would.

The memory store is reached through its ``put_row``/``get_row``; DynamoDB through a
plain boto3 client (the backend's view of the table), never through the store
under test.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import boto3
from boto3.dynamodb.types import TypeDeserializer, TypeSerializer

from server.store.base import Store
from server.store.dynamodb import DynamoStore
from server.store.memory import MemoryStore
from tests.conftest import TEST_REGION

_serializer = TypeSerializer()
_deserializer = TypeDeserializer()


def _plain(value: Any) -> Any:
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class Rows:
    """put/get of whole rows, with plain Python values (ints, not Decimals)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._client: Any = None
        if isinstance(store, DynamoStore):
            self._client = boto3.client(
                "dynamodb", endpoint_url=store.endpoint_url, region_name=TEST_REGION
            )

    def put(self, pk: str, sk: str, attributes: dict[str, Any] | None = None) -> None:
        attributes = attributes or {}
        if isinstance(self.store, MemoryStore):
            self.store.put_row(pk, sk, attributes)
            return
        item = {"pk": pk, "sk": sk, **attributes}
        self._client.put_item(
            TableName=self._table,
            Item={k: _serializer.serialize(v) for k, v in item.items()},
        )

    def delete(self, pk: str, sk: str) -> None:
        if isinstance(self.store, MemoryStore):
            self.store.delete_row(pk, sk)
            return
        self._client.delete_item(TableName=self._table, Key={"pk": {"S": pk}, "sk": {"S": sk}})

    def get(self, pk: str, sk: str) -> dict[str, Any] | None:
        if isinstance(self.store, MemoryStore):
            return self.store.get_row(pk, sk)
        response = self._client.get_item(
            TableName=self._table, Key={"pk": {"S": pk}, "sk": {"S": sk}}, ConsistentRead=True
        )
        item = response.get("Item")
        if item is None:
            return None
        plain = {k: _plain(_deserializer.deserialize(v)) for k, v in item.items()}
        plain.pop("pk")
        plain.pop("sk")
        return plain

    @property
    def _table(self) -> str:
        assert isinstance(self.store, DynamoStore)
        return self.store.table
