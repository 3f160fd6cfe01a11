"""Token buckets: how many of something may happen per second, with a burst.

One bucket per socket bounds the frames it may send (flood credits, as
lila-ws does); one per node bounds how fast new connections are admitted.
"""

from __future__ import annotations

import math


class TokenBucket:
    """``capacity`` tokens at most, refilled at ``rate`` tokens per second."""

    __slots__ = ("_stamp", "_tokens", "capacity", "rate")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self._tokens = capacity
        self._stamp = now

    def take(self, now: float, amount: float = 1.0) -> bool:
        """Spend ``amount`` tokens if there are that many; False leaves the bucket as it was."""
        tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if tokens < amount:
            self._tokens = tokens
            return False
        self._tokens = tokens - amount
        return True

    def retry_after(self, now: float) -> int:
        """Whole seconds until one token is there again (at least 1, for Retry-After)."""
        tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
        if tokens >= 1:
            return 1
        return max(1, math.ceil((1 - tokens) / self.rate))
