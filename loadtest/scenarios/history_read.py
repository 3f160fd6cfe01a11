"""Node CPU per stream history read on one Redis, in batches as a recovery storm asks.

    python -m loadtest.scenarios.history_read [--streams 256] [--events 10]
        [--batches 200] [--rounds 3]

A reconnecting client's ``since`` becomes one history read per stream, and a
node gathers them into batches (``server/routing/history_reads.py``) that go to
``RedisStreams.read_many``: one ``READ`` script per stream, all in one round trip.
This fills ``--streams`` streams with ``--events`` events of 200 bytes each, then
reads all of them from after the first event, ``--batches`` times a round, and
reports this process's CPU (``time.process_time``) and the wall time per stream
read, on a local ``redis-server`` started here. Decoding the envelopes is not
measured (``HistoryReads`` does it, the same whatever reads).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

from loadtest.harness.servers import start_redis
from loadtest.report.summary import print_benchmark
from server.bus.redis_streams import RedisStreams


async def _per_read(
    streams: RedisStreams, names: Sequence[str], batches: int
) -> tuple[float, float]:
    """Microseconds of this process's CPU, and of wall time, per stream read."""
    asks = [(name, 1) for name in names]
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(batches):
        reads = await streams.read_many(asks)
        assert all(len(read.entries) == read.top - 1 for read in reads)
    reads_done = batches * len(names)
    return (
        (time.process_time() - cpu) / reads_done * 1e6,
        (time.perf_counter() - wall) / reads_done * 1e6,
    )


async def run(streams_count: int, events: int, batches: int, rounds: int) -> dict[str, Any]:
    redis_proc, redis_url = await start_redis()
    try:
        streams = RedisStreams(redis_url)
        await streams.start()
        names = [f"game:bench#{i}" for i in range(streams_count)]
        for name in names:
            for _ in range(events):
                await streams.append(name, b"x" * 200, (name,))
        await _per_read(streams, names, max(1, batches // 10))  # warm up
        cpu: list[float] = []
        wall: list[float] = []
        for _ in range(rounds):
            round_cpu, round_wall = await _per_read(streams, names, batches)
            cpu.append(round(round_cpu, 1))
            wall.append(round(round_wall, 1))
        await streams.close()
        return {
            "streams_per_batch": streams_count,
            "events_read_per_stream": events - 1,
            "batches_per_round": batches,
            "cpu_us_per_read": cpu,
            "wall_us_per_read": wall,
        }
    finally:
        redis_proc.stop()


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {number}")
    return number


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.scenarios.history_read", description=__doc__
    )
    parser.add_argument("--streams", type=_positive, default=256, help="streams a batch reads")
    parser.add_argument("--events", type=_positive, default=10, help="events in each stream")
    parser.add_argument("--batches", type=_positive, default=200, help="batches a round")
    parser.add_argument("--rounds", type=_positive, default=3)
    args = parser.parse_args(argv)
    results = asyncio.run(run(args.streams, args.events, args.batches, args.rounds))
    print_benchmark(parser.prog, argv, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
