"""CoalescingFlusher: values merged per key, and a failed batch never overrides newer ones.

None is a real value for presence reports (a user gone offline), so a pending
None must count as pending: the bug these tests pin let a failed join, retried,
overwrite the leave queued behind it, and the user stayed online forever.
"""

from __future__ import annotations

import asyncio

from server.runtime.metrics import Registry
from server.runtime.write_behind import CoalescingFlusher

WITHIN = 10.0


def newest(_older: bool | None, newer: bool | None) -> bool | None:
    return newer


async def test_a_failed_join_retried_does_not_override_the_leave_queued_behind_it() -> None:
    written: list[dict[str, bool | None]] = []
    first_batch_out = asyncio.Event()
    fail_it = asyncio.Event()

    async def write(batch: dict[str, bool | None]) -> dict[str, bool | None]:
        if not written:
            written.append({})
            first_batch_out.set()
            await fail_it.wait()
            raise ConnectionError("Redis went away")
        written.append(dict(batch))
        return {}

    failures = Registry().counter("ap_test_failures_total", "failed writes")
    flusher: CoalescingFlusher[str, bool | None] = CoalescingFlusher(
        "test", write, newest, failures
    )
    flusher.start()
    try:
        flusher.put("alice", True)  # the join: its write will fail
        await asyncio.wait_for(first_batch_out.wait(), WITHIN)
        flusher.put("alice", None)  # the leave, queued while the join is out
        fail_it.set()
        await asyncio.wait_for(flusher.drained(), WITHIN)
    finally:
        await flusher.close()
    assert written[1:] == [{"alice": None}]


async def test_a_pending_none_is_merged_like_any_other_value() -> None:
    merged: list[tuple[int | None, int | None]] = []

    def remember(older: int | None, newer: int | None) -> int | None:
        merged.append((older, newer))
        return newer

    async def write(batch: dict[str, int | None]) -> dict[str, int | None]:
        return {}

    failures = Registry().counter("ap_test_failures_total", "failed writes")
    flusher: CoalescingFlusher[str, int | None] = CoalescingFlusher(
        "test", write, remember, failures
    )
    flusher.put("k", None)
    flusher.put("k", 1)
    assert merged == [(None, 1)]
    assert flusher.backlog == 1


async def test_a_failed_batch_is_merged_under_what_came_after_it() -> None:
    written: list[dict[str, int]] = []
    released = asyncio.Event()
    out = asyncio.Event()

    async def write(batch: dict[str, int]) -> dict[str, int]:
        if not written:
            written.append({})
            out.set()
            await released.wait()
            return dict(batch)  # every entry failed
        written.append(dict(batch))
        return {}

    failures = Registry().counter("ap_test_failures_total", "failed writes")
    flusher: CoalescingFlusher[str, int] = CoalescingFlusher(
        "test", write, lambda older, newer: older + newer, failures
    )
    flusher.start()
    try:
        flusher.put("a", 1)
        flusher.put("b", 10)
        await asyncio.wait_for(out.wait(), WITHIN)
        flusher.put("a", 2)  # newer than the failed 1: merged as (1, 2)
        released.set()
        await asyncio.wait_for(flusher.drained(), WITHIN)
    finally:
        await flusher.close()
    assert written[1:] == [{"a": 3, "b": 10}]
    assert failures.value == 2
