"""Stores: the narrow persistence interface and its implementations."""

from server.store.base import (
    BotRecord,
    ConnectionRecord,
    CurrentGame,
    Store,
    StoreUnavailable,
    ttl_from_now,
)
from server.store.memory import MemoryStore

__all__ = [
    "BotRecord",
    "ConnectionRecord",
    "CurrentGame",
    "MemoryStore",
    "Store",
    "StoreUnavailable",
    "ttl_from_now",
]
