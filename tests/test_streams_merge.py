"""Property tests of the sans-I/O stream logic: the recovery merge and the cursor.

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
from protocol.streams import HistoryRead, Step, StreamCursor, contiguous_after, merge_recovery

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
