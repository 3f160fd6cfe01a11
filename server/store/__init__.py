"""Stores: the narrow persistence interface and its implementations."""

from server.store.base import ConnectionRecord, Store, StoreUnavailable, ttl_from_now
from server.store.memory import MemoryStore

__all__ = ["ConnectionRecord", "MemoryStore", "Store", "StoreUnavailable", "ttl_from_now"]
