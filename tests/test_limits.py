"""Token buckets (flood credits, accept rate), the reclaimer, and the game-key rule in parse."""

from __future__ import annotations

import pytest

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import WatchGames
from protocol.parse import parse_broadcast, parse_client_frame
from server.runtime.metrics import Registry
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
