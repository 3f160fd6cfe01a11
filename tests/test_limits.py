"""Token buckets (flood credits), the accept window, the reclaimer, the game-key rule."""

from __future__ import annotations

import pytest

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import WatchGames
from protocol.parse import parse_broadcast, parse_client_frame
from server.runtime.metrics import Registry
from server.runtime.rate_window import RateWindow
from server.runtime.reclaim import Reclaimer
from server.runtime.token_bucket import TokenBucket


def test_a_bucket_gives_its_burst_then_its_rate() -> None:
    bucket = TokenBucket(capacity=3, rate=2.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.retry_after(0.0) == 1
    assert bucket.take(0.5)  # one token back after half a second at 2/s
    assert not bucket.take(0.5)
    assert bucket.take(100.0, 3) and not bucket.take(100.0)  # refills to capacity, no more


def test_a_costly_frame_spends_several_credits() -> None:
    bucket = TokenBucket(capacity=10, rate=0.001, now=0.0)
    assert bucket.take(0.0, 8)
    assert not bucket.take(0.0, 8)  # refused, and nothing was spent
    assert bucket.take(0.0, 2)


def test_a_reservation_waits_its_turn_in_order_and_keeps_every_window_to_the_limit() -> None:
    window = RateWindow(2)
    waits = [window.reserve(0.0, within=1.0) for _ in range(5)]
    # two now, then each a window after the one two places before it, until past 1 s
    assert waits == [0.0, 0.0, 1.0, 1.0, None]
    # the refused one reserved nothing: the next turn is still at 2.0
    assert window.reserve(0.5, within=1.0) is None
    assert window.reserve(0.5, within=1.5) == 1.5
    assert not window.take(1.9)  # taking is reserving with no wait
    # whatever the arrivals, the reserved moments never put three in one second
    moments: list[float] = []
    for t in (x / 10 for x in range(30, 60)):
        wait = window.reserve(t, within=2.0)
        if wait is not None:
            moments.append(t + wait)
    assert moments == sorted(moments)
    assert len(moments) >= 6
    assert all(b - a >= 1.0 - 1e-9 for a, b in zip(moments, moments[2:], strict=False))


def test_retry_after_is_whole_seconds_until_a_token() -> None:
    bucket = TokenBucket(capacity=1, rate=0.25, now=0.0)
    assert bucket.take(0.0)
    assert bucket.retry_after(0.0) == 4


def test_the_reclaimer_runs_a_young_collection_and_counts_it() -> None:
    metrics = Registry()
    reclaimer = Reclaimer(metrics)
    before = metrics.value("ap_memory_reclaims_total")
    for _ in range(5):
        reclaimer.closed()
    reclaimer.reclaim()
    assert metrics.value("ap_memory_reclaims_total") == before + 1
    assert reclaimer.closes == 0
    assert reclaimer.longest >= 0


@pytest.mark.parametrize(
    "frame",
    [
        '{"action":"watchGames","games":[{"meta":"a#b","id":"c"}]}',
        '{"action":"subscribe","token":"t","games":[{"meta":"#","id":"c"}]}',
    ],
)
def test_a_meta_with_a_hash_is_refused_by_the_parser(frame: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        parse_client_frame(frame)
    assert refused.value.code is ErrorCode.INVALID_MESSAGE


def test_an_id_with_a_hash_is_fine_and_publish_refuses_a_meta_with_one() -> None:
    action = parse_client_frame('{"action":"watchGames","games":[{"meta":"a","id":"b#c"}]}')
    assert isinstance(action, WatchGames) and action.games == frozenset({"a#b#c"})
    with pytest.raises(ProtocolError):
        parse_broadcast('{"verb":"chat","payload":{"meta":"a#b","id":"c"}}')


def test_the_accept_window_admits_at_most_its_limit_in_any_second() -> None:
    window = RateWindow(3)
    assert [window.take(t) for t in (0.0, 0.1, 0.2, 0.3)] == [True, True, True, False]
    assert window.retry_after(0.3) == 1
    # a bucket would have refilled by now; the window waits for the first to age out
    assert not window.take(0.99)
    assert window.take(1.0) and not window.take(1.05)
    assert window.take(1.1) and window.take(1.2) and not window.take(1.95)
    # whatever the arrivals, no window of one second holds more than the limit
    admitted = [t / 100 for t in range(0, 500, 3) if window.take(2.0 + t / 100)]
    assert all(
        sum(1 for u in admitted if s <= u < s + 1) <= 3 for s in (x / 100 for x in range(400))
    )
    with pytest.raises(ValueError):
        RateWindow(0)
