"""The one backoff helper, with an injected clock, random source and sleep: no real waits."""

from __future__ import annotations

import pytest

from server.runtime.backoff import Backoff


def top(low: float, high: float) -> float:
    return high


def bottom(low: float, high: float) -> float:
    return low


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_waits_double_from_the_first_up_to_the_cap() -> None:
    backoff = Backoff(first=0.1, cap=1.0)
    assert [backoff.delay(n, top) for n in range(1, 7)] == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    )


def test_jitter_keeps_each_wait_within_its_bounds() -> None:
    half = Backoff(first=0.4, cap=5.0)
    assert (half.delay(2, bottom), half.delay(2, top)) == pytest.approx((0.4, 0.8))
    full = Backoff(first=0.4, cap=5.0, jitter=1.0)
    assert full.delay(2, bottom) == 0.0 and full.delay(2, top) == pytest.approx(0.8)
    fixed = Backoff(first=1.0, cap=1.0, jitter=0.0)
    assert fixed.delay(1, bottom) == fixed.delay(9, top) == 1.0
    # With the real random source, every wait still falls inside the bounds.
    assert all(0.4 <= half.delay(2) <= 0.8 for _ in range(1000))


def test_a_loop_that_fails_for_days_still_gets_the_cap() -> None:
    backoff = Backoff(first=0.05, cap=5.0)
    assert backoff.delay(10**6, top) == 5.0
    assert backoff.ceiling(0) == 0.05


async def test_attempts_count_every_try_the_first_included() -> None:
    time = FakeTime()
    retrying = Backoff(first=0.1, cap=1.0, attempts=3).start(
        clock=time.clock, sleep=time.sleep, uniform=top
    )
    assert await retrying.wait()  # after try 1
    assert await retrying.wait()  # after try 2
    assert not await retrying.wait()  # try 3 failed: no fourth
    assert time.slept == pytest.approx([0.1, 0.2])
    assert retrying.failures == 3


async def test_reset_after_a_success_starts_from_the_first_wait_again() -> None:
    time = FakeTime()
    retrying = Backoff(first=0.1, cap=1.0, attempts=3).start(
        clock=time.clock, sleep=time.sleep, uniform=top
    )
    for _ in range(4):
        assert await retrying.wait()
        retrying.reset()
    assert time.slept == pytest.approx([0.1] * 4)


async def test_without_a_limit_it_retries_for_ever() -> None:
    time = FakeTime()
    retrying = Backoff(first=0.1, cap=2.0).start(clock=time.clock, sleep=time.sleep, uniform=top)
    for _ in range(1000):
        assert await retrying.wait()
    assert time.slept[-1] == 2.0 and len(time.slept) == 1000


async def test_no_wait_ends_past_the_deadline_and_the_last_try_is_at_it() -> None:
    time = FakeTime()
    retrying = Backoff(first=1.0, cap=1.0, jitter=0.0).start(
        deadline=time.now + 2.5, clock=time.clock, sleep=time.sleep
    )
    tries = [time.now]
    while await retrying.wait():
        tries.append(time.now)
    assert time.slept == pytest.approx([1.0, 1.0, 0.5])
    assert tries[-1] == pytest.approx(102.5)  # the last try, at the deadline
    assert time.now == pytest.approx(102.5)  # and nothing waited past it


async def test_a_deadline_already_past_gives_up_at_once() -> None:
    time = FakeTime()
    retrying = Backoff(first=0.1, cap=1.0).start(
        deadline=time.now - 1, clock=time.clock, sleep=time.sleep
    )
    assert retrying.next_delay() is None
    assert not await retrying.wait()
    assert time.slept == []


def test_nonsense_policies_are_refused() -> None:
    for bad in (
        {"first": 0.0, "cap": 1.0},
        {"first": 2.0, "cap": 1.0},
        {"first": 0.1, "cap": 1.0, "jitter": 1.5},
        {"first": 0.1, "cap": 1.0, "factor": 0.5},
        {"first": 0.1, "cap": 1.0, "attempts": 0},
    ):
        with pytest.raises(ValueError):
            Backoff(**bad)  # type: ignore[arg-type]
