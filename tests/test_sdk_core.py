"""The Python SDK's decisions, with plain values: the close-code policy and backoff,
positions, duplicates, gaps, recovery, coalescing, commits, presence, turns, storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apclient.events import Event, Presence, RecoveryInfo, ResyncInfo
from apclient.policy import (
    BACKOFF_MAX,
    BACKOFF_MIN,
    OVERLOAD_MIN,
    RESTART_SPREAD,
    Plan,
    Wait,
    backoff_delay,
    close_plan,
    connect_plan,
    wait_seconds,
)
from apclient.presence import apply_presence
from apclient.storage import FileStorage, MemoryStorage, storage_for
from apclient.streams import (
    Advance,
    Commits,
    Deliver,
    Output,
    Report,
    Resync,
    StreamFrame,
    Tracker,
    Verdict,
    judge,
)
from apclient.turns import TurnTracker
from protocol.messages import (
    Ply,
    Position,
    PresenceDelta,
    PresenceSnapshot,
    Recovered,
    ply_fields,
    ply_of,
)

G = "game:chess#g1"

# --- the close-code policy -------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "error", "refreshed", "expected"),
    [
        (1012, None, False, Plan(stop=False, wait=Wait.RESTART)),
        (1013, "unavailable", False, Plan(stop=False, wait=Wait.OVERLOAD)),
        (4509, "too_many_connections", False, Plan(stop=True)),
        (1008, "unauthorized", False, Plan(stop=False, wait=Wait.REFRESH)),
        (1008, "unauthorized", True, Plan(stop=True)),
        (1008, "rate_limited", True, Plan(stop=False, wait=Wait.OVERLOAD, bug=True)),
        (4008, None, False, Plan(stop=False, wait=Wait.BACKOFF)),
        (4408, None, False, Plan(stop=False, wait=Wait.BACKOFF, bug=True)),
        (1001, None, False, Plan(stop=False, wait=Wait.VISIBLE)),
        (1006, None, False, Plan(stop=False, wait=Wait.BACKOFF)),
        (1011, None, False, Plan(stop=False, wait=Wait.BACKOFF)),
        (1000, None, False, Plan(stop=False, wait=Wait.BACKOFF)),
    ],
)
def test_the_close_code_policy(
    code: int, error: str | None, refreshed: bool, expected: Plan
) -> None:
    plan = close_plan(code, opened=True, error=error, refreshed=refreshed)
    assert (plan.stop, plan.wait, plan.bug) == (expected.stop, expected.wait, expected.bug)
    # 4008 warns, 4408 is logged as a client bug, a stop says why
    assert (plan.log is not None) == (code in (4008, 4408, 4509) or plan.stop or plan.bug)


def test_a_socket_that_never_opened_backs_off_as_overload() -> None:
    assert close_plan(1006, opened=False, error=None, refreshed=False).wait is Wait.OVERLOAD
    assert connect_plan(status=503).wait is Wait.OVERLOAD
    assert connect_plan(status=429).wait is Wait.OVERLOAD
    assert connect_plan(status=None, timed_out=True).wait is Wait.OVERLOAD
    # a refused connection (a node down): the ordinary step, and try the next address
    assert connect_plan(status=None).wait is Wait.BACKOFF
    assert connect_plan(status=404).log is not None


@given(st.integers(0, 60), st.floats(0, 1))
def test_backoff_is_exponential_with_full_jitter_within_bounds(attempt: int, r: float) -> None:
    delay = backoff_delay(attempt, rand=lambda: r)
    ceiling = min(BACKOFF_MAX, 2.0 * 2**attempt)
    assert BACKOFF_MIN <= delay <= ceiling <= BACKOFF_MAX
    overload = backoff_delay(attempt, OVERLOAD_MIN, rand=lambda: r)
    assert OVERLOAD_MIN <= overload <= BACKOFF_MAX


def test_backoff_spreads_over_its_whole_window() -> None:
    assert backoff_delay(0, rand=lambda: 0.0) == 0.5
    assert backoff_delay(0, rand=lambda: 1.0) == 2.0  # a dead node's clients spread out
    assert backoff_delay(1, rand=lambda: 1.0) == 4.0
    assert backoff_delay(3, rand=lambda: 1.0) == 16.0
    assert backoff_delay(0, OVERLOAD_MIN, rand=lambda: 1.0) == 10.0
    assert backoff_delay(30, rand=lambda: 1.0) == BACKOFF_MAX


def test_waits() -> None:
    assert wait_seconds(Wait.RESTART, 9, rand=lambda: 1.0) == RESTART_SPREAD
    assert wait_seconds(Wait.RESTART, 9, rand=lambda: 0.0) == 0.0
    assert wait_seconds(Wait.OVERLOAD, 0, rand=lambda: 0.0) == OVERLOAD_MIN
    assert wait_seconds(Wait.BACKOFF, 0, retry_after=7, rand=lambda: 0.0) == 7
    assert wait_seconds(Wait.REFRESH, 0, rand=lambda: 0.0) == BACKOFF_MIN


# --- positions, duplicates, gaps --------------------------------------------------


def frame(offset: int, verb: str = "game", epoch: str = "e1", stream: str = G) -> StreamFrame:
    payload = None if verb == "skip" else {"meta": "chess", "id": "g1", "n": offset}
    return StreamFrame(verb, payload, stream, epoch, offset)


def delivered(outputs: list[Output]) -> list[Event]:
    return [o.event for o in outputs if isinstance(o, Deliver)]


def resyncs(outputs: list[Output]) -> list[ResyncInfo]:
    return [o.info for o in outputs if isinstance(o, Resync)]


def test_judge() -> None:
    assert judge(None, "e", 5) is Verdict.FIRST
    assert judge(Position("", 0), "e", 5) is Verdict.FIRST
    assert judge(Position("e", 4), "e", 5) is Verdict.NEXT
    assert judge(Position("e", 4), "e", 4) is Verdict.OLD
    assert judge(Position("e", 4), "e", 7) is Verdict.GAP
    assert judge(Position("e", 4), "f", 1) is Verdict.EPOCH


def test_live_events_are_delivered_once_and_in_order() -> None:
    tracker = Tracker({})
    out = tracker.frame(frame(1)) + tracker.frame(frame(2)) + tracker.frame(frame(2))
    out += tracker.frame(frame(1))
    assert [e.offset for e in delivered(out)] == [1, 2]
    assert [o.commit for o in out if isinstance(o, Deliver)] == [
        Position("e1", 1),
        Position("e1", 2),
    ]
    assert tracker.position(G) == Position("e1", 2)
    assert not any(e.replayed for e in delivered(out))


def test_a_gap_or_a_new_epoch_resyncs_then_delivers() -> None:
    tracker = Tracker({G: Position("e1", 3)})
    out = tracker.frame(frame(6))
    assert resyncs(out) == [ResyncInfo(G, "gap", "e1", 6)]
    assert [e.offset for e in delivered(out)] == [6]
    assert isinstance(out[0], Resync) and out[0].commit is None  # the event commits
    out = tracker.frame(frame(1, epoch="e2"))
    assert resyncs(out) == [ResyncInfo(G, "epoch", "e2", 1)]
    assert tracker.position(G) == Position("e2", 1)


def test_a_skip_moves_the_position_without_a_delivery() -> None:
    tracker = Tracker({G: Position("e1", 1)})
    out = tracker.frame(frame(2, "skip")) + tracker.frame(frame(3))
    assert out[0] == Advance(G, Position("e1", 2))
    assert [e.offset for e in delivered(out)] == [3]
    assert resyncs(out) == []


def test_recovery_marks_replays_and_reports() -> None:
    tracker = Tracker({G: Position("e1", 2)})
    assert tracker.begin([G, "user:u"]) == {G: Position("e1", 2), "user:u": Position("", 0)}
    out = tracker.frame(frame(3)) + tracker.frame(frame(4))
    out += tracker.answer(Recovered(G, True, "e1", 4))
    out += tracker.answer(Recovered("user:u", False, "u1", 7))
    assert [(e.offset, e.replayed) for e in delivered(out)] == [(3, True), (4, True)]
    reports = [o for o in out if isinstance(o, Report)]
    assert [r.info for r in reports] == [
        RecoveryInfo(G, True, True, 2, "e1", 4),
        RecoveryInfo("user:u", False, False, 0, "u1", 7),  # a first look is no loss
    ]
    assert [r.commit for r in reports] == [Position("e1", 4), Position("u1", 7)]
    assert resyncs(out) == []
    assert tracker.position("user:u") == Position("u1", 7)
    live = tracker.frame(frame(5))
    assert [(e.offset, e.replayed) for e in delivered(live)] == [(5, False)]


def test_a_failed_recovery_resyncs_once_when_the_answer_arrives() -> None:
    tracker = Tracker({G: Position("e1", 2)})
    tracker.begin([G])
    out = tracker.answer(Recovered(G, False, "e2", 9))
    assert resyncs(out) == [ResyncInfo(G, "recovery", "e2", 9, True, False, 0)]
    (resync,) = [o for o in out if isinstance(o, Resync)]
    assert resync.commit == Position("e2", 9)
    (report,) = [o for o in out if isinstance(o, Report)]
    assert report.commit is None  # the resync commits
    assert tracker.position(G) == Position("e2", 9)
    # the next live event follows on, with no second resync
    assert resyncs(tracker.frame(frame(10, epoch="e2"))) == []


def test_a_live_recovered_false_is_a_loss() -> None:
    tracker = Tracker({G: Position("e1", 2)})
    out = tracker.answer(Recovered(G, False, "e1", 5))
    assert [r.reason for r in resyncs(out)] == ["recovery"]


def test_a_replayed_burst_of_a_coalesced_verb_is_one_call() -> None:
    tracker = Tracker({G: Position("e1", 0)}, coalesce=["game"])
    tracker.begin([G])
    out: list[Output] = []
    for offset in range(1, 5):
        out += tracker.frame(frame(offset))
    out += tracker.frame(frame(5, "skip"))
    assert delivered(out) == []  # held until the burst ends
    out += tracker.frame(frame(6, "chat"))  # another verb ends it
    out += tracker.frame(frame(7))
    out += tracker.answer(Recovered(G, True, "e1", 7))
    events = delivered(out)
    assert [(e.verb, e.offset, len(e.batch)) for e in events] == [
        ("game", 4, 4),
        ("chat", 6, 1),
        ("game", 7, 1),
    ]
    assert [p["n"] for p in events[0].batch] == [1, 2, 3, 4]  # nothing dropped, in order
    commits = [o.commit for o in out if isinstance(o, Deliver)]
    assert commits[0] == Position("e1", 5)  # the held skip moves with the burst
    # live events are never held
    assert [e.offset for e in delivered(tracker.frame(frame(8)))] == [8]


def test_a_closed_socket_hands_over_a_held_burst() -> None:
    tracker = Tracker({}, coalesce=["game"])
    tracker.begin([G])
    tracker.frame(frame(1))
    tracker.frame(frame(2))
    out = tracker.reset()
    assert [(e.offset, e.batch) for e in delivered(out)] == [
        (2, ({"meta": "chess", "id": "g1", "n": 1}, {"meta": "chess", "id": "g1", "n": 2}))
    ]
    assert not tracker.recovering(G)


@given(st.lists(st.integers(1, 30), max_size=60))
def test_whatever_arrives_each_offset_reaches_the_application_at_most_once(
    offsets: list[int],
) -> None:
    tracker = Tracker({}, coalesce=["game"])
    tracker.begin([G])
    seen: list[int] = []
    for i, offset in enumerate(offsets):
        if i == len(offsets) // 2:
            for out in tracker.answer(Recovered(G, True, "e1", offset)):
                if isinstance(out, Deliver):
                    seen += [p["n"] for p in out.event.batch]
        for out in tracker.frame(frame(offset)):
            if isinstance(out, Deliver):
                seen += [p["n"] for p in out.event.batch]
    seen += [p["n"] for e in delivered(tracker.reset()) for p in e.batch]
    assert seen == sorted(set(seen))  # increasing: nothing twice, nothing backwards


def test_commits_advance_in_order_only_as_far_as_handlers_are_done() -> None:
    commits = Commits({})
    first = commits.expect(G, Position("e", 1), 2)
    second = commits.expect(G, Position("e", 2), 1)
    assert not commits.release(second)  # done, but the first is not
    assert G not in commits.committed
    assert not commits.release(first)
    assert commits.release(first)
    assert commits.committed[G] == Position("e", 2)
    commits.expect(G, Position("e", 3), 0)
    assert commits.settle(G) and commits.committed[G] == Position("e", 3)
    assert commits.outstanding() == 0


# --- presence, turns, storage ---------------------------------------------------


def test_presence_is_kept_as_the_browser_keeps_it() -> None:
    snapshot = PresenceSnapshot(4, 2, ("a", "b"))
    presence, gap = apply_presence(None, snapshot)
    assert presence == Presence(4, 2, frozenset({"a", "b"})) and not gap
    presence, gap = apply_presence(presence, PresenceDelta(5, ("c",), ("a",), 2))
    assert presence == Presence(5, 2, frozenset({"b", "c"})) and not gap
    same, gap = apply_presence(presence, PresenceDelta(5, ("x",), (), 3))
    assert same == presence and not gap
    same, gap = apply_presence(presence, PresenceDelta(7, ("x",), (), 3))
    assert same == presence and gap  # answered with syncPresence
    counted, _ = apply_presence(presence, PresenceDelta(6, ("x", "y"), (), -1))
    assert counted is not None and counted.total_count == 4
    assert apply_presence(None, PresenceDelta(1, (), (), 0)) == (None, True)


def _refs(candidates: list[tuple[tuple[str, str], Ply | None]]) -> list[tuple[str, str]]:
    return [ref for ref, _ in candidates]


G1, G2 = ("chess", "g1"), ("chess", "g2")


def test_a_game_without_plies_is_a_turn_once_per_change() -> None:
    turns = TurnTracker()
    assert _refs(turns.offer([(G1, None), (G2, None)])) == [G1, G2]
    # the same plies again: a yourTurn that raced the pendingTurns, a reconnect's list
    assert turns.offer([(G1, None)]) == []
    assert turns.offer([(G1, None), (G2, None)]) == []
    turns.changed("game:chess#g1")  # a move (the bot's own shows as a skip)
    turns.changed("user:bot")  # other streams change nothing
    assert _refs(turns.offer([(G1, None), (G2, None)])) == [G1]


def test_a_game_with_plies_is_a_turn_exactly_once_per_ply() -> None:
    turns = TurnTracker()
    assert turns.offer([(G1, Ply(4, 1000.0))]) == [(G1, Ply(4, 1000.0))]
    # a comment on the game, then the reconnect's list names the same ply: no turn
    turns.changed("game:chess#g1")
    assert turns.offer([(G1, Ply(4, 1000.0))]) == []
    # a re-sent yourTurn (ping_bot) of that ply, after a resync of the stream: none
    turns.changed("game:chess#g1")
    assert turns.offer([(G1, Ply(4))]) == []
    # a stale list that raced the next turn names an older ply: none
    assert turns.offer([(G1, Ply(6, 3000.0))]) == [(G1, Ply(6, 3000.0))]
    assert turns.offer([(G1, Ply(4, 1000.0))]) == []
    # with nothing else in the game, the next ply is a turn: no frame is needed
    assert turns.offer([(G1, Ply(8))]) == [(G1, Ply(8))]
    # only lastMoveTime: compared by time once numMoves is not on both
    assert turns.offer([(G2, Ply(time=5.0))]) == [(G2, Ply(time=5.0))]
    assert turns.offer([(G2, Ply(time=5.0))]) == []
    assert turns.offer([(G2, Ply(time=7.0))]) == [(G2, Ply(time=7.0))]


def test_plies_and_no_plies_mixed() -> None:
    turns = TurnTracker()
    assert _refs(turns.offer([(G1, None)])) == [G1]  # a yourTurn {meta, id}
    # the reconnect's list names the ply: nothing happened since, so it is that turn
    assert turns.offer([(G1, Ply(4))]) == []
    turns.changed("game:chess#g1")  # a comment: the known ply still decides
    assert turns.offer([(G1, Ply(4))]) == []
    assert turns.offer([(G1, Ply(5))]) == [(G1, Ply(5))]
    # a turn without a ply after something happened: new, and its ply unknown
    turns.changed("game:chess#g1")
    assert turns.offer([(G1, None)]) == [(G1, None)]
    assert turns.offer([(G1, None)]) == []


def test_a_ply_is_read_from_a_turns_fields() -> None:
    assert ply_of({"meta": "chess", "id": "g1"}) is None
    assert ply_of({"numMoves": 12, "lastMoveTime": 1700000000000}) == Ply(12, 1700000000000)
    assert ply_of({"numMoves": True, "lastMoveTime": 1.5}) == Ply(None, 1.5)
    assert ply_of({"numMoves": -1, "lastMoveTime": "x"}) is None
    assert ply_of(["not", "a", "dict"]) is None
    assert ply_fields(Ply(3)) == {"numMoves": 3}


def test_positions_survive_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "positions.json"
    storage = storage_for(path)
    assert isinstance(storage, FileStorage) and storage.load() == {}
    storage.save({G: Position("e", 3), "user:u": Position("", 0)})
    assert FileStorage(path).load() == {G: Position("e", 3), "user:u": Position("", 0)}
    assert [p.name for p in tmp_path.iterdir()] == ["positions.json"]  # replaced atomically
    path.write_text("{not json")
    assert FileStorage(path).load() == {}
    path.write_text('{"a": ["e", "x"], "b": ["e", 2]}')
    assert FileStorage(path).load() == {"b": Position("e", 2)}
    memory: Any = storage_for(None)
    assert isinstance(memory, MemoryStorage)
    memory.save({G: Position("e", 1)})
    assert memory.load() == {G: Position("e", 1)}


def test_after_a_failure_another_address_is_picked_at_random() -> None:
    from apclient import RealtimeClient

    draws = iter([0.0, 0.99, 0.5, 0.0])
    client = RealtimeClient(["a", "b", "c"], get_token=lambda: "t", rand=lambda: next(draws))
    picked = []
    for _ in range(4):
        client._url_index = client._next_url()
        picked.append(client._url_index)
    # never the one that failed; over the others, by the draw
    assert picked == [1, 0, 2, 0]
    single = RealtimeClient("a", get_token=lambda: "t")
    assert single._next_url() == 0
