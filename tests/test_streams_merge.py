"""Tests of the sans-I/O stream logic, on plain values: the recovery merge and
answer, the node's cursor (each live event, each repair read) and the replay filter.

The merge model: a stream has ``published`` events; a client last saw offset
``since``; the node took its subscription after event ``subscribed_at`` and
read the history after event ``read_at`` (so ``subscribed_at <= read_at``); the
history kept the last ``size`` events; live events after ``subscribed_at``
arrived in order up to ``arrived`` before the merge, the rest arrive after it.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from protocol.messages import Position
from protocol.streams import (
    Arrival,
    HistoryRead,
    RecoveryAnswer,
    Repair,
    Step,
    StreamCursor,
    already_sent,
    answer_recovery,
    contiguous_after,
    merge_recovery,
    unannounced,
)

EPOCH = "e1"


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, int, int, int, int, int, bool]:
    published = draw(st.integers(0, 60))
    subscribed_at = draw(st.integers(0, published))
    read_at = draw(st.integers(subscribed_at, published))
    arrived = draw(st.integers(subscribed_at, published))
    since = draw(st.integers(0, published + 3))
    size = draw(st.integers(1, 20))
    same_epoch = draw(st.booleans())
    return published, subscribed_at, read_at, arrived, since, size, same_epoch


def history_at(read_at: int, size: int, after: int) -> HistoryRead[str]:
    first = max(1, read_at - size + 1)
    entries = tuple((o, f"ev{o}") for o in range(first, read_at + 1) if o > after)
    return HistoryRead(EPOCH, read_at, entries)


@given(scenarios())
def test_merge_is_exact_or_honestly_refused(
    scenario: tuple[int, int, int, int, int, int, bool],
) -> None:
    published, subscribed_at, read_at, arrived, since, size, same_epoch = scenario
    history = history_at(read_at, size, since)
    buffered = [(EPOCH, o, f"ev{o}") for o in range(subscribed_at + 1, arrived + 1)]
    client = Position(EPOCH if same_epoch else "e0", since)

    plan = merge_recovery(client, history, buffered)

    # Provable: the events the client missed are all held by the history window
    # or by the live buffer (either may cover what the other lost).
    newest = max(read_at, arrived)
    held = set(range(max(1, read_at - size + 1), read_at + 1)) | set(
        range(subscribed_at + 1, arrived + 1)
    )
    provable = (
        same_epoch and since <= read_at and all(o in held for o in range(since + 1, newest + 1))
    )
    # The usual case, in plain terms: the history alone reaches back far enough.
    if same_epoch and read_at - size <= since <= read_at:
        assert provable
    assert plan.recovered is provable
    assert plan.epoch == EPOCH
    assert plan.offset == newest
    if not plan.recovered:
        assert plan.events == (), "a partial replay is never sent"
        return
    # Exactly the missed events, in order, once, with their own content.
    assert [o for o, _ in plan.events] == list(range(since + 1, newest + 1))
    assert all(event == f"ev{o}" for o, event in plan.events)
    # Live events after the merge continue without a gap or a duplicate once the
    # client drops what is at or below its position (what the node does).
    later = [o for o in range(subscribed_at + 1, published + 1) if o > arrived]
    seen = [o for o, _ in plan.events] + [o for o in later if o > plan.offset]
    assert contiguous_after(since, seen)
    assert seen[-1:] == ([published] if published > since else [])


@given(
    st.integers(0, 30),
    st.integers(1, 20),
    st.lists(st.integers(1, 40), max_size=20),
)
def test_a_hole_in_the_live_buffer_is_never_presented_as_recovered(
    since: int, size: int, lost: list[int]
) -> None:
    read_at = since + 5
    history = history_at(read_at, size, since)
    buffered = [(EPOCH, o, f"ev{o}") for o in range(read_at - 2, read_at + 15) if o not in lost]
    plan = merge_recovery(Position(EPOCH, since), history, buffered)
    if plan.recovered:
        offsets = [o for o, _ in plan.events]
        assert offsets == list(range(since + 1, plan.offset + 1))
        held = {o for o, _ in history.entries} | {o for _, o, _ in buffered}
        assert set(offsets) <= held


@given(st.integers(0, 20), st.integers(1, 10))
def test_a_new_epoch_in_the_buffer_refuses_recovery(since: int, offset: int) -> None:
    history = history_at(since + 2, 50, since)
    plan = merge_recovery(Position(EPOCH, since), history, [("e2", offset, "x")])
    assert not plan.recovered and plan.events == ()
    assert (plan.epoch, plan.offset) == ("e2", offset - 1)


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 30)), max_size=60))
def test_the_cursor_delivers_a_strictly_increasing_run_per_epoch(
    arrivals: list[tuple[str, int]],
) -> None:
    cursor = StreamCursor()
    delivered: list[tuple[str, int]] = []
    for epoch, offset in arrivals:
        step = cursor.step(epoch, offset)
        if step is Step.DUPLICATE:
            assert cursor.epoch == epoch and offset <= cursor.offset
            continue
        if step is Step.GAP:
            assert cursor.epoch == epoch and offset > cursor.offset + 1
        if step is Step.DELIVER and cursor.epoch is not None:
            assert offset == cursor.offset + 1
        cursor.advance(epoch, offset)
        delivered.append((epoch, offset))
    for (e1, o1), (e2, o2) in itertools.pairwise(delivered):
        assert e1 != e2 or o2 > o1


@given(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 30), st.booleans()), max_size=60)
)
def test_receive_moves_the_cursor_only_to_what_it_delivers_and_reports_every_loss(
    arrivals: list[tuple[str, int, bool]],
) -> None:
    cursor = StreamCursor()
    heard: tuple[str, int] | None = None  # the speakers' last point: an event, or a refetch
    for epoch, offset, repairing in arrivals:
        before = (cursor.epoch, cursor.offset)
        step = StreamCursor(*before).step(epoch, offset)
        arrival = cursor.receive(epoch, offset, repairing=repairing)
        assert arrival.step is step
        unfillable = step in (Step.GAP, Step.NEW_EPOCH) and repairing
        assert arrival.deliver is (step is Step.DELIVER or unfillable)
        assert arrival.repair is (step in (Step.GAP, Step.NEW_EPOCH) and not repairing)
        assert arrival.lost == (Position(epoch, offset - 1) if unfillable else None)
        if arrival.deliver:
            assert (cursor.epoch, cursor.offset) == (epoch, offset)
        else:
            assert (cursor.epoch, cursor.offset) == before
        if arrival.lost is not None:
            heard = (arrival.lost.epoch, arrival.lost.offset)
        if arrival.deliver:
            # Each delivery after the first continues what the speakers last heard:
            # the previous event, or the point they were told to refetch up to.
            assert heard is None or heard == (epoch, offset - 1)
            heard = (epoch, offset)


@given(
    st.one_of(st.none(), st.sampled_from(["a", "b"])),
    st.integers(0, 10),
    st.sampled_from(["a", "b"]),
    st.integers(1, 12),
)
def test_take_next_moves_only_to_the_next_event_of_the_cursors_own_epoch(
    at_epoch: str | None, at_offset: int, epoch: str, offset: int
) -> None:
    cursor = StreamCursor(at_epoch, at_offset)
    step = StreamCursor(at_epoch, at_offset).step(epoch, offset)
    moved = cursor.take_next(epoch, offset)
    assert moved is (at_epoch is not None and step is Step.DELIVER)
    assert (cursor.epoch, cursor.offset) == ((epoch, offset) if moved else (at_epoch, at_offset))


def test_receive_on_plain_values() -> None:
    cursor = StreamCursor()
    assert cursor.receive("e1", 7, repairing=False) == Arrival(Step.DELIVER, True)
    assert cursor.receive("e1", 7, repairing=False) == Arrival(Step.DUPLICATE, False)
    assert cursor.receive("e1", 8, repairing=False) == Arrival(Step.DELIVER, True)
    gap = cursor.receive("e1", 11, repairing=False)
    assert gap == Arrival(Step.GAP, False) and gap.repair
    assert (cursor.epoch, cursor.offset) == ("e1", 8)
    assert cursor.receive("e1", 11, repairing=True) == Arrival(Step.GAP, True, Position("e1", 10))
    new_epoch = cursor.receive("e2", 3, repairing=False)
    assert new_epoch == Arrival(Step.NEW_EPOCH, False) and new_epoch.repair
    assert (cursor.epoch, cursor.offset) == ("e1", 11)
    assert cursor.receive("e2", 3, repairing=True) == Arrival(
        Step.NEW_EPOCH, True, Position("e2", 2)
    )
    assert (cursor.epoch, cursor.offset) == ("e2", 3)


@given(
    st.one_of(st.none(), st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 10))),
    st.sampled_from(["a", "b"]),
    st.integers(1, 12),
)
def test_an_event_past_a_clients_position_is_announced_first(
    last: tuple[str, int] | None, epoch: str, offset: int
) -> None:
    skips = unannounced(last, epoch, offset)
    if last is None or already_sent(last, epoch, offset):
        assert not skips
    else:
        # Sent now, it must continue the client's position exactly, or be announced.
        assert skips is (last != (epoch, offset - 1))


def window(epoch: str, top: int, size: int, after: int) -> HistoryRead[str]:
    first = max(1, top - size + 1)
    return HistoryRead(epoch, top, tuple((o, f"ev{o}") for o in range(first, top + 1) if o > after))


@given(
    st.integers(0, 30),
    st.integers(0, 40),
    st.integers(1, 20),
    st.booleans(),
)
def test_a_repair_read_fills_the_hole_or_reports_exactly_what_is_gone(
    at: int, top: int, size: int, same_epoch: bool
) -> None:
    history = window(EPOCH if same_epoch else "e2", top, size, at)
    cursor = StreamCursor(EPOCH, at)
    repair = cursor.fill(history)
    entries = [o for o, _ in history.entries]
    whole = same_epoch and (entries[0] == at + 1 if entries else top <= at)
    assert (repair.lost is None) is whole
    base = at if repair.lost is None else repair.lost.offset
    if repair.lost is not None:
        assert repair.lost == Position(history.epoch, entries[0] - 1 if entries else top)
    # Every event the history still holds past the base is delivered, in order, once.
    delivered = [o for o, _ in repair.events]
    assert contiguous_after(base, delivered)
    assert delivered == [o for o in entries if o > base]
    assert all(event == f"ev{o}" for o, event in repair.events)
    assert (cursor.epoch, cursor.offset) == (history.epoch, delivered[-1] if delivered else base)


def test_repair_reads_on_plain_values() -> None:
    def fill(at: int, history: HistoryRead[str]) -> tuple[Repair[str], tuple[str | None, int]]:
        cursor = StreamCursor(EPOCH, at)
        repair = cursor.fill(history)
        return repair, (cursor.epoch, cursor.offset)

    # The hole is in history: filled, nothing lost.
    assert fill(4, HistoryRead(EPOCH, 6, ((5, "a"), (6, "b")))) == (
        Repair(None, ((5, "a"), (6, "b"))),
        (EPOCH, 6),
    )
    # Trimmed past the hole: refetch up to just before what is left, then deliver it.
    assert fill(4, HistoryRead(EPOCH, 9, ((8, "c"), (9, "d")))) == (
        Repair(Position(EPOCH, 7), ((8, "c"), (9, "d"))),
        (EPOCH, 9),
    )
    # Nothing kept, yet the stream is ahead: refetch up to its top.
    assert fill(4, HistoryRead(EPOCH, 9, ())) == (Repair(Position(EPOCH, 9), ()), (EPOCH, 9))
    # A new epoch: refetch, then what the new epoch holds.
    assert fill(4, HistoryRead("e2", 2, ((1, "x"), (2, "y")))) == (
        Repair(Position("e2", 0), ((1, "x"), (2, "y"))),
        ("e2", 2),
    )
    # Nothing new (the check after a reconnect found no hole).
    assert fill(4, HistoryRead(EPOCH, 4, ())) == (Repair(None, ()), (EPOCH, 4))


def test_already_sent_drops_only_what_the_replay_covered() -> None:
    assert not already_sent(None, EPOCH, 1)
    assert already_sent((EPOCH, 5), EPOCH, 5)
    assert already_sent((EPOCH, 5), EPOCH, 3)
    assert not already_sent((EPOCH, 5), EPOCH, 6)
    assert not already_sent(("e0", 5), EPOCH, 2)


@given(scenarios())
def test_the_recovery_answer_is_the_merge_then_what_lies_beyond_it(
    scenario: tuple[int, int, int, int, int, int, bool],
) -> None:
    _, subscribed_at, read_at, arrived, since, size, same_epoch = scenario
    history = history_at(read_at, size, since)
    buffered = [(EPOCH, o, f"ev{o}") for o in range(subscribed_at + 1, arrived + 1)]
    client = Position(EPOCH if same_epoch else "e0", since)
    plan = merge_recovery(client, history, buffered)
    answer = answer_recovery(client, history, buffered)
    assert (answer.recovered, answer.epoch, answer.offset, answer.replay) == (
        plan.recovered,
        plan.epoch,
        plan.offset,
        plan.events,
    )
    if answer.recovered:
        assert answer.live == ()
    else:
        assert answer.live == tuple((o, e) for _, o, e in buffered if o > plan.offset)


def test_an_unreadable_history_is_answered_from_the_live_buffer() -> None:
    since = Position(EPOCH, 3)
    assert answer_recovery(since, None, []) == RecoveryAnswer(False, EPOCH, 0, (), ())
    buffered = [(EPOCH, 5, "a"), (EPOCH, 6, "b")]
    assert answer_recovery(since, None, buffered) == RecoveryAnswer(
        False, EPOCH, 4, (), ((5, "a"), (6, "b"))
    )
    # A new epoch behind the first buffered event: only the first epoch's events follow.
    changed = [(EPOCH, 5, "a"), ("e2", 1, "x")]
    assert answer_recovery(since, None, changed) == RecoveryAnswer(False, EPOCH, 4, (), ((5, "a"),))
    # A failed merge (the stream changed epoch after the read) is followed by the new epoch.
    history = HistoryRead(EPOCH, 4, ((4, "d"),))
    assert answer_recovery(since, history, [("e2", 2, "y"), ("e2", 3, "z")]) == RecoveryAnswer(
        False, "e2", 1, (), ((2, "y"), (3, "z"))
    )
