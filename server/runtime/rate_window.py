"""At most ``limit`` events in any window of ``seconds``: a sliding window.

A token bucket with a second of burst admits up to twice its rate within one
second (the full bucket, then the refill). The node's accept rate is a promise
about every second (``--accept-rate``), so new connections are counted here
instead: the times of the last ``limit`` admissions, oldest first.
"""

from __future__ import annotations

import math
from collections import deque


class RateWindow:
    __slots__ = ("_times", "limit", "seconds")

    def __init__(self, limit: int, seconds: float = 1.0) -> None:
        if limit < 1:
            raise ValueError("a rate window admits at least one event")
        self.limit = limit
        self.seconds = seconds
        self._times: deque[float] = deque(maxlen=limit)

    def take(self, now: float) -> bool:
        """Admit one event at ``now`` unless ``limit`` were admitted since ``now - seconds``."""
        return self.reserve(now, 0.0) is not None

    def reserve(self, now: float, within: float) -> float | None:
        """Admit one event at the first moment the window allows: the seconds until then.

        Reserved moments count as admissions, so those who wait are admitted in
        order and no window of ``seconds`` ever holds more than ``limit`` of them;
        None (and nothing reserved) when the wait would exceed ``within`` seconds.
        """
        times = self._times
        at = now if len(times) < self.limit else max(now, times[0] + self.seconds)
        if at - now > within:
            return None
        times.append(at)  # times stay sorted; the oldest falls out, a window before ``at``
        return at - now

    def retry_after(self, now: float) -> int:
        """Whole seconds until the next admission (at least 1, for Retry-After)."""
        times = self._times
        if len(times) < self.limit:
            return 1
        return max(1, math.ceil(times[0] + self.seconds - now))
