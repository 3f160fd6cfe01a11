"""Background writes that wait their turn behind delivery.

A connect storm queues thousands of write-behind rows (``lastSeen``,
``wsConnections``) at the moment fan-out is busiest. Each batch costs the
node CPU to encode, sign and parse; run at once, it competes with the frames
clients wait for. Before each batch the writer asks ``Pacer.turn``, which
watches the process for a short probe (``poll_s``) and measures the share of
it the event loop's thread wanted a CPU. A share above ``busy_share`` means
delivery (or anything else) is using the CPU: the batch waits another probe.
Once the loop's thread has run ``max_wait`` CPU-seconds of other work since the
wait began, it goes anyway, and after ``max_wall`` seconds at the latest: writes
are delayed by delivery, never starved. The bound is counted in the node's own
CPU time, not in wall time, so forced writes take the same share of the node's
work whether it has a CPU to itself or a fraction of one.

The share is CPU demand over wall time, not the loop's lag: a loop saturated
by many short callbacks (a few hundred recipients per publish) comes back
from a yield at once, yet has no CPU to spare. Demand is the time the thread
ran plus the time it was ready to run but waited for a CPU
(``/proc/thread-self/schedstat``): on a machine shared with other processes,
or under a CPU quota, a busy loop gets only part of a CPU, and its CPU time
alone would look like spare capacity.

One pacer serves all of a node's writers, one at a time: under a load that
never lets up, the writers together get one forced turn per ``max_wait``,
not one each.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

BUSY_SHARE = 0.6
"""A probe in which the loop's thread wanted a CPU more than this share of the time is busy."""
POLL_S = 0.02
MAX_WAIT_S = 1.0
"""CPU-seconds the loop's thread runs for others before a waiting write goes anyway."""
MAX_WALL_S = 5.0
"""Wall seconds after which a waiting write goes anyway, however little CPU the node got."""
SCHEDSTAT = "/proc/thread-self/schedstat"


def _demand(raw: bytes) -> float:
    ran, waited = raw.split()[:2]
    return (int(ran) + int(waited)) / 1e9


def schedstat_demand(path: str = SCHEDSTAT) -> float:
    """Seconds the calling thread ran plus those it waited, runnable, for a CPU."""
    with open(path, "rb") as stat:
        return _demand(stat.read())


class ThreadDemand:
    """``schedstat_demand`` of the thread that first calls it, read through a
    descriptor kept for the process's life (one per node; a tenth of the cost of
    opening the file at each probe)."""

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self._path = path
        self._fd: int | None = None

    def __call__(self) -> float:
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        return _demand(os.pread(self._fd, 128, 0))


def demand_clock(path: str = SCHEDSTAT) -> Callable[[], float]:
    """``ThreadDemand`` where the kernel keeps it (Linux), else process CPU time."""
    try:
        schedstat_demand(path)
    except (OSError, ValueError):
        return time.process_time
    return ThreadDemand(path)


class Pacer:
    def __init__(
        self,
        *,
        busy_share: float = BUSY_SHARE,
        poll_s: float = POLL_S,
        max_wait_s: float = MAX_WAIT_S,
        max_wall_s: float = MAX_WALL_S,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] | None = None,
        run_clock: Callable[[], float] = time.thread_time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._busy_share = busy_share
        self._poll_s = poll_s
        self._max_wait_s = max_wait_s
        self._max_wall_s = max_wall_s
        self._clock = clock
        self._cpu_clock = demand_clock() if cpu_clock is None else cpu_clock
        self._run_clock = run_clock  # CPU time of the thread that calls turn(): the loop's
        self._sleep = sleep
        self._queue = asyncio.Lock()  # FIFO: writers take their turns in the order they asked
        self.waits = 0
        """Probes that found the process busy (all turns)."""
        self.forced = 0
        """Turns that went ahead at a bound while the process was still busy."""

    async def turn(self) -> None:
        """Return after a probe with CPU to spare, or at a bound (``max_wait`` of the
        loop's CPU time or ``max_wall``) at the latest, counted from when this
        writer's wait began, behind any writer ahead of it."""
        async with self._queue:
            await self._wait()

    async def _wait(self) -> None:
        deadline = self._clock() + self._max_wall_s
        ran_out = self._run_clock() + self._max_wait_s
        while True:
            wall, cpu = self._clock(), self._cpu_clock()
            await self._sleep(self._poll_s)
            elapsed = self._clock() - wall
            share = (self._cpu_clock() - cpu) / elapsed if elapsed > 0 else 0.0
            if share <= self._busy_share:
                return
            if self._run_clock() >= ran_out or self._clock() >= deadline:
                self.forced += 1
                return
            self.waits += 1
