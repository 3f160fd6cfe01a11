"""How long to wait before trying again: one jittered exponential backoff for every retry loop.

A :class:`Backoff` is a policy (first wait, cap, tries, jitter); :meth:`Backoff.start`
begins one run of retries under it, which counts the failures, says how long to
wait, and says when to give up: after ``attempts`` tries, or at a deadline.

The n-th wait is random in ``[c * (1 - jitter), c]`` where ``c = min(cap, first *
factor ** (n - 1))``. The default jitter, 0.5, keeps every wait at least half its
ceiling: the clients of a restarted Redis or DynamoDB do not retry in step, and
none comes back at once to a backend that just refused it. ``jitter=1`` is full
jitter; ``jitter=0`` a fixed schedule.

With a deadline, no wait ends past it: the last one is cut short so that the
last try happens at the deadline, and a failure at or after it gives up.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
Uniform = Callable[[float, float], float]

_MAX_EXPONENT = 64
"""Past this many doublings any ceiling is the cap; also keeps the power finite
for a loop that has retried for days."""


@dataclass(frozen=True)
class Backoff:
    first: float
    """Ceiling of the first wait, in seconds."""
    cap: float
    """No wait is longer."""
    factor: float = 2.0
    jitter: float = 0.5
    """Each wait is uniform in ``[ceiling * (1 - jitter), ceiling]``."""
    attempts: int | None = None
    """Tries in all, the first included; None: retry until success or the deadline."""

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap:
            raise ValueError(f"need 0 < first <= cap, got first={self.first} cap={self.cap}")
        if self.factor < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"need factor >= 1 and 0 <= jitter <= 1: {self}")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")

    def ceiling(self, retry: int) -> float:
        """The longest wait before retry number ``retry`` (1-based)."""
        exponent = min(max(0, retry - 1), _MAX_EXPONENT)
        return min(self.cap, self.first * self.factor**exponent)

    def delay(self, retry: int, uniform: Uniform = random.uniform) -> float:
        """A wait before retry number ``retry`` (1-based), jittered."""
        ceiling = self.ceiling(retry)
        return uniform(ceiling * (1 - self.jitter), ceiling)

    def start(
        self,
        *,
        deadline: float | None = None,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        uniform: Uniform = random.uniform,
    ) -> Retrying:
        """One run of retries; ``deadline`` is on ``clock`` (``time.monotonic()``)."""
        return Retrying(self, deadline, clock, sleep, uniform)


class Retrying:
    """One run of retries under a :class:`Backoff`.

    ::

        retrying = BACKOFF.start(deadline=time.monotonic() + 30)
        while True:
            try:
                return await call()
            except OSError:
                if not await retrying.wait():
                    raise
    """

    __slots__ = ("_clock", "_sleep", "_uniform", "backoff", "deadline", "failures")

    def __init__(
        self, backoff: Backoff, deadline: float | None, clock: Clock, sleep: Sleep, uniform: Uniform
    ) -> None:
        self.backoff = backoff
        self.deadline = deadline
        self.failures = 0  # since the start or the last reset()
        self._clock = clock
        self._sleep = sleep
        self._uniform = uniform

    def reset(self) -> None:
        """A success: the next failure waits the first wait again."""
        self.failures = 0

    def next_delay(self) -> float | None:
        """Count a failure; the wait before the next try, or None to give up."""
        self.failures += 1
        attempts = self.backoff.attempts
        if attempts is not None and self.failures >= attempts:
            return None
        delay = self.backoff.delay(self.failures, self._uniform)
        if self.deadline is not None:
            left = self.deadline - self._clock()
            if left <= 0:
                return None
            delay = min(delay, left)
        return delay

    async def wait(self) -> bool:
        """Count a failure and wait before the next try; False (at once) to give up."""
        delay = self.next_delay()
        if delay is None:
            return False
        await self._sleep(delay)
        return True
