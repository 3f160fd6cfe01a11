"""The loop's stalls and the collector's pauses are counted, and told apart from a busy host."""

from __future__ import annotations

import asyncio
import gc
import time

from server.runtime.metrics import Registry
from server.runtime.pauses import PauseWatch


def stalls_of(metrics: Registry) -> float:
    return metrics.value("ap_loop_stalls_total")


def busy_stalls_of(metrics: Registry) -> float:
    return metrics.value("ap_loop_busy_stalls_total")


async def test_a_long_step_of_this_process_is_a_busy_stall() -> None:
    metrics = Registry()
    watch = PauseWatch(metrics)
    watch.start()
    try:
        await asyncio.sleep(0.1)  # the watcher is waiting on its tick
        stalls, busy = (
            metrics.value("ap_loop_stalls_total"),
            metrics.value("ap_loop_busy_stalls_total"),
        )
        end = time.thread_time() + 0.15
        while time.thread_time() < end:  # 150 ms of this thread's own CPU, no yield
            pass
        await asyncio.sleep(0.1)
        assert (
            metrics.value("ap_loop_stalls_total") >= stalls + 1
        )  # a busy host may add one of its own
        assert busy_stalls_of(metrics) == busy + 1
        assert watch.longest_lag >= 0.1
    finally:
        await watch.stop()


async def test_a_wait_off_the_cpu_is_a_stall_but_not_a_busy_one() -> None:
    metrics = Registry()
    watch = PauseWatch(metrics)
    watch.start()
    try:
        await asyncio.sleep(0.1)
        stalls, busy = (
            metrics.value("ap_loop_stalls_total"),
            metrics.value("ap_loop_busy_stalls_total"),
        )
        time.sleep(0.15)  # noqa: ASYNC251 - the loop blocked, but this process did not compute
        await asyncio.sleep(0.1)
        assert (
            metrics.value("ap_loop_stalls_total") >= stalls + 1
        )  # a busy host may add one of its own
        assert busy_stalls_of(metrics) == busy
    finally:
        await watch.stop()


async def test_collections_are_timed() -> None:
    metrics = Registry()
    watch = PauseWatch(metrics)
    watch.start()
    try:
        before = metrics.value("ap_gc_pause_seconds_total")
        garbage = [[i] for i in range(200_000)]
        del garbage
        gc.collect()
        assert metrics.value("ap_gc_pause_seconds_total") > before
        assert watch.longest_gc > 0
    finally:
        await watch.stop()
    assert watch._on_gc not in gc.callbacks
