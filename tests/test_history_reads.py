"""The node's batched history reads (server/routing/history_reads.py), over the real MemoryStreams.

``CountingStreams`` is MemoryStreams itself; it only records each ``read_many``
and can hold a batch in flight, to see what joins which round trip.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from protocol.envelope import encode_envelope
from protocol.messages import Broadcast, GameEvent
from protocol.streams import HistoryRead
from server.bus import MemoryBus
from server.bus.streams import HistoryAsk, MemoryStreams
from server.routing.history_reads import HistoryReads
from tests.waiting import eventually


class CountingStreams(MemoryStreams):
    def __init__(self) -> None:
        super().__init__(MemoryBus())
        self.batches: list[list[HistoryAsk]] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.fail: Exception | None = None

    async def read_many(self, asks: Sequence[HistoryAsk]) -> list[HistoryRead[bytes]]:
        self.batches.append(list(asks))
        await self.hold.wait()
        if self.fail is not None:
            raise self.fail
        return await super().read_many(asks)


def event(game: str, n: int) -> bytes:
    payload = {"meta": "chess", "id": game, "n": n}
    return encode_envelope(Broadcast(GameEvent("game", "chess", game, payload)))


async def append(streams: MemoryStreams, game: str, count: int) -> None:
    for n in range(count):
        await streams.append(f"game:chess#{game}", event(game, n), ())


def numbers(read: HistoryRead[Broadcast]) -> list[int]:
    out = []
    for _, message in read.entries:
        assert isinstance(message.event, GameEvent)
        out.append(message.event.payload["n"])
    return out


async def test_asks_of_one_turn_share_one_round_trip_and_equal_asks_one_read() -> None:
    streams = CountingStreams()
    await append(streams, "a", 5)
    await append(streams, "b", 2)
    reads = HistoryReads(streams)
    asks = [("game:chess#a", 3), ("game:chess#b", 0), ("game:chess#a", 3), ("game:chess#a", 0)]
    got = await asyncio.gather(*(reads.read(stream, after) for stream, after in asks))
    assert streams.batches == [[("game:chess#a", 3), ("game:chess#b", 0), ("game:chess#a", 0)]]
    assert [numbers(read) for read in got] == [[3, 4], [0, 1], [3, 4], [0, 1, 2, 3, 4]]
    assert [read.top for read in got] == [5, 2, 5, 5]
    assert got[0] is got[2]  # one read, one decoding


async def test_an_ask_made_while_a_batch_is_out_gets_a_later_read() -> None:
    # The merge relies on it: a read must not be older than its asker's subscription.
    streams = CountingStreams()
    await append(streams, "a", 2)
    reads = HistoryReads(streams)
    streams.hold.clear()
    first = asyncio.create_task(reads.read("game:chess#a", 0))
    await eventually(lambda: len(streams.batches) == 1, 30)
    await append(streams, "a", 1)  # after the first batch went out
    second = asyncio.create_task(reads.read("game:chess#a", 0))
    await eventually(lambda: len(streams.batches) == 2, 30)  # two in flight at once by default
    streams.hold.set()
    assert (await first).top in (2, 3)  # held, then read: it may see the later event
    later = await second
    assert later.top == 3 and numbers(later) == [0, 1, 0]


async def test_batches_are_capped_in_size_and_in_number_out_at_once() -> None:
    streams = CountingStreams()
    reads = HistoryReads(streams, batch_size=4, in_flight=2)
    streams.hold.clear()
    tasks = [asyncio.create_task(reads.read(f"game:chess#g{i}", 0)) for i in range(11)]
    # Until two batches are out (held there), however slowly the loop gets to them.
    for _ in range(3000):
        if len(streams.batches) >= 2:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # room for a wrong third one
    assert [len(batch) for batch in streams.batches] == [4, 4]
    assert reads.queued == 3
    streams.hold.set()
    got = await asyncio.gather(*tasks)
    assert [len(batch) for batch in streams.batches] == [4, 4, 3]
    assert all(read.top == 0 and read.epoch for read in got)


async def test_a_failed_batch_fails_its_askers_and_the_next_one_reads() -> None:
    streams = CountingStreams()
    await append(streams, "a", 1)
    reads = HistoryReads(streams)
    streams.fail = ConnectionError("redis away")
    results = await asyncio.gather(
        reads.read("game:chess#a", 0), reads.read("game:chess#b", 0), return_exceptions=True
    )
    assert all(isinstance(r, ConnectionError) for r in results)
    streams.fail = None
    assert numbers(await reads.read("game:chess#a", 0)) == [0]


async def test_an_asker_that_goes_away_does_not_cancel_the_read_for_the_others() -> None:
    streams = CountingStreams()
    await append(streams, "a", 2)
    reads = HistoryReads(streams)
    streams.hold.clear()
    leaving = asyncio.create_task(reads.read("game:chess#a", 0))
    staying = asyncio.create_task(reads.read("game:chess#a", 0))
    await eventually(lambda: len(streams.batches) == 1, 30)
    leaving.cancel()
    streams.hold.set()
    assert numbers(await staying) == [0, 1]
    with pytest.raises(asyncio.CancelledError):
        await leaving


async def test_close_cancels_what_waits() -> None:
    streams = CountingStreams()
    reads = HistoryReads(streams, in_flight=1)
    streams.hold.clear()
    out = asyncio.create_task(reads.read("game:chess#a", 0))
    await eventually(lambda: len(streams.batches) == 1, 30)
    queued = asyncio.create_task(reads.read("game:chess#b", 0))
    await eventually(lambda: reads.queued == 1, 30)
    await reads.close()
    for task in (out, queued):
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_events_are_decoded_once_across_batches_and_junk_ends_the_run() -> None:
    streams = CountingStreams()
    await append(streams, "a", 2)
    await streams.append("game:chess#a", b"not an envelope", ())
    await append(streams, "a", 1)
    reads = HistoryReads(streams)
    first = await reads.read("game:chess#a", 0)
    second = await reads.read("game:chess#a", 0)
    assert len(streams.batches) == 2
    assert first.top == second.top == 4
    assert numbers(first) == numbers(second) == [0, 1]  # the hole at 3 ends what is usable
    assert all(a[1] is b[1] for a, b in zip(first.entries, second.entries, strict=True))


async def test_read_each_answers_every_ask_in_its_place_sharing_the_batch() -> None:
    streams = CountingStreams()
    await append(streams, "a", 3)
    await append(streams, "b", 1)
    reads = HistoryReads(streams)
    asks = [("game:chess#a", 1), ("game:chess#b", 0), ("game:chess#c", 0)]
    one, other = await asyncio.gather(reads.read_each(asks), reads.read_each(asks[:1]))
    assert streams.batches == [asks]  # both askers in one round trip
    assert [numbers(read) for read in one if isinstance(read, HistoryRead)] == [[1, 2], [0], []]
    assert [read.top for read in one if isinstance(read, HistoryRead)] == [3, 1, 0]
    assert other[0] is one[0]


async def test_read_each_puts_a_failed_read_in_its_place() -> None:
    streams = CountingStreams()
    reads = HistoryReads(streams)
    streams.fail = ConnectionError("redis away")
    got = await reads.read_each([("game:chess#a", 0), ("game:chess#b", 0)])
    assert [type(read) for read in got] == [ConnectionError, ConnectionError]


async def test_a_read_each_that_goes_away_leaves_the_reads_to_the_others() -> None:
    streams = CountingStreams()
    await append(streams, "a", 2)
    reads = HistoryReads(streams)
    streams.hold.clear()
    leaving = asyncio.create_task(reads.read_each([("game:chess#a", 0), ("game:chess#b", 0)]))
    staying = asyncio.create_task(reads.read("game:chess#a", 0))
    await eventually(lambda: len(streams.batches) == 1, 30)
    leaving.cancel()
    streams.hold.set()
    assert numbers(await staying) == [0, 1]
    with pytest.raises(asyncio.CancelledError):
        await leaving


async def test_read_each_of_reads_cancelled_by_close_holds_cancellations() -> None:
    streams = CountingStreams()
    reads = HistoryReads(streams)
    streams.hold.clear()
    asking = asyncio.create_task(reads.read_each([("game:chess#a", 0)]))
    await eventually(lambda: len(streams.batches) == 1, 30)
    await reads.close()
    got = await asking
    assert [type(read) for read in got] == [asyncio.CancelledError]
