"""Verified tokens, remembered so a reconnect storm verifies each token once.

Keyed by a hash of the token (the cache never holds a token itself), bounded
in size (least recently used goes first), and an entry is never used at or
after its token's ``exp``.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class TokenCache(Generic[T]):
    def __init__(self, size: int, clock: Callable[[], float] = time.time) -> None:
        self.size = size
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[T, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    def get(self, token: str) -> T | None:
        if self.size <= 0:
            return None
        key = self._key(token)
        entry = self._entries.get(key)
        if entry is None:
            return None
        value, expires_at = entry
        if self._clock() >= expires_at:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, token: str, value: T, expires_at: float) -> None:
        if self.size <= 0 or self._clock() >= expires_at:
            return
        key = self._key(token)
        self._entries[key] = (value, expires_at)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
