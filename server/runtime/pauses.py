"""Where the event loop stops serving: collector pauses and late wake-ups.

Every client on a node waits while the loop is busy with one thing, so a
node's tail latency is the length of its longest steps. Two gauges say which
steps those are: the collector's pauses, timed from ``gc.callbacks`` per
generation, and the loop's lag, timed by a task that asks to wake every
``LAG_TICK`` seconds and records how late it woke.

Counters (pauses, stalls and their seconds) can be differenced between two
scrapes; the longest pauses are since the process started.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

from server.runtime.metrics import Registry

log = logging.getLogger(__name__)

LAG_TICK = 0.05
LAG_REPORTED = 0.02
"""Wake-ups later than this count as a stall (20 ms: well above a normal step)."""


class PauseWatch:
    """The process's pauses (collector, late loop wake-ups), on a node's registry."""

    def __init__(self, metrics: Registry | None = None) -> None:
        registry = metrics or Registry()
        self._gc_pause_seconds = registry.counter(
            "ap_gc_pause_seconds_total", "Time the loop spent in the garbage collector"
        )
        self._gc_full_collections = registry.counter(
            "ap_gc_full_collections_total", "Collections of the oldest generation (the long ones)"
        )
        self._gc_long_pauses = registry.counter(
            "ap_gc_long_pauses_total", f"Collector pauses longer than {LAG_REPORTED * 1000:g} ms"
        )
        self._loop_stalls = registry.counter(
            "ap_loop_stalls_total", f"Times the loop woke more than {LAG_REPORTED * 1000:g} ms late"
        )
        self._loop_stall_seconds = registry.counter(
            "ap_loop_stall_seconds_total", "How late the loop woke, summed over those stalls"
        )
        self._loop_busy_stalls = registry.counter(
            "ap_loop_busy_stalls_total",
            "Stalls in which this process itself computed for longer than a stall: its own long "
            "steps, as opposed to waiting for a CPU that others held",
        )
        self.longest_gc = 0.0
        self.longest_lag = 0.0
        self._gc_started = 0.0
        self._task: asyncio.Task[None] | None = None
        registry.gauge(
            "ap_gc_longest_pause_seconds",
            "Longest garbage-collector pause",
            lambda: self.longest_gc,
        )
        registry.gauge(
            "ap_loop_longest_lag_seconds",
            "Longest late wake-up of the loop",
            lambda: self.longest_lag,
        )

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.create_task(self._watch_lag(), name="loop-lag")

    async def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        took = time.perf_counter() - self._gc_started
        self._gc_pause_seconds.inc(took)
        self.longest_gc = max(self.longest_gc, took)
        if took > LAG_REPORTED:
            self._gc_long_pauses.inc()
            log.info(
                "collector paused the loop %.0f ms (generation %s, %s freed)",
                took * 1000,
                info.get("generation"),
                info.get("collected"),
            )
        if info.get("generation") == 2:
            self._gc_full_collections.inc()

    async def _watch_lag(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + LAG_TICK
            cpu = time.thread_time()
            await asyncio.sleep(LAG_TICK)
            lag = loop.time() - asked
            if lag > LAG_REPORTED:
                self._loop_stalls.inc()
                self._loop_stall_seconds.inc(lag)
                if time.thread_time() - cpu > LAG_TICK + LAG_REPORTED:
                    self._loop_busy_stalls.inc()
            self.longest_lag = max(self.longest_lag, lag)
