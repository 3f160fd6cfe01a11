"""Verified tokens, remembered so a reconnect storm verifies each token once.

Keyed by a hash of the token (the cache never holds a token itself), bounded
in size (least recently used goes first), and an entry is never used at or
after its token's ``exp``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class TokenCache(Generic[T]):
    def __init__(self, size: int, clock: Callable[[], float] = time.time) -> None:
        self.size = size
        self._clock = clock
        # A plain dict keeps insertion order: re-inserting on use makes it an
        # LRU at half the memory of an OrderedDict (~300 bytes an entry in all).
        self._entries: dict[bytes, tuple[T, float]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(token: str) -> bytes:
        # 128 bits: collisions are out of reach, and the key stays small.
        return hashlib.blake2b(token.encode(), digest_size=16).digest()

    def get(self, token: str) -> T | None:
        if self.size <= 0:
            return None
        key = self._key(token)
        entry = self._entries.get(key)
        if entry is None:
            return None
        value, expires_at = entry
        del self._entries[key]
        if self._clock() >= expires_at:
            return None
        self._entries[key] = entry  # now the most recently used
        return value

    def put(self, token: str, value: T, expires_at: float) -> None:
        if self.size <= 0 or self._clock() >= expires_at:
            return
        key = self._key(token)
        self._entries.pop(key, None)
        self._entries[key] = (value, expires_at)
        while len(self._entries) > self.size:
            del self._entries[next(iter(self._entries))]
