"""The loop's stalls and the collector's pauses are counted, and told apart from a busy host."""

from __future__ import annotations

import asyncio
import gc
import time

from server.runtime.pauses import PauseWatch, gc_pause_seconds, loop_busy_stalls, loop_stalls


async def test_a_long_step_of_this_process_is_a_busy_stall() -> None:
    watch = PauseWatch()
    watch.start()
    try:
        await asyncio.sleep(0.1)  # the watcher is waiting on its tick
        stalls, busy = loop_stalls.value, loop_busy_stalls.value
        end = time.thread_time() + 0.15
        while time.thread_time() < end:  # 150 ms of this thread's own CPU, no yield
            pass
        await asyncio.sleep(0.1)
        assert loop_stalls.value >= stalls + 1  # a busy host may add one of its own
        assert loop_busy_stalls.value == busy + 1
        assert watch.longest_lag >= 0.1
    finally:
        await watch.stop()


async def test_a_wait_off_the_cpu_is_a_stall_but_not_a_busy_one() -> None:
    watch = PauseWatch()
    watch.start()
    try:
        await asyncio.sleep(0.1)
        stalls, busy = loop_stalls.value, loop_busy_stalls.value
        time.sleep(0.15)  # noqa: ASYNC251 - the loop blocked, but this process did not compute
        await asyncio.sleep(0.1)
        assert loop_stalls.value >= stalls + 1  # a busy host may add one of its own
        assert loop_busy_stalls.value == busy
    finally:
        await watch.stop()


async def test_collections_are_timed() -> None:
    watch = PauseWatch()
    watch.start()
    try:
        before = gc_pause_seconds.value
        garbage = [[i] for i in range(200_000)]
        del garbage
        gc.collect()
        assert gc_pause_seconds.value > before
        assert watch.longest_gc > 0
    finally:
        await watch.stop()
    assert watch._on_gc not in gc.callbacks
