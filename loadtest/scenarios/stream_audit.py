"""What the stream audit costs a node and its Redis, per held stream.

    python -m loadtest.scenarios.stream_audit [--streams 25000] [--rounds 3]

A cluster node reads the position of every stream it holds every
``--stream-audit-seconds`` (``server/routing/stream_audit.py``). This holds
``--streams`` game streams of one event each (the recovery scenario's node holds
up to 25,000), all in step, on a local ``redis-server`` started here, and times
full audits: this process's CPU (``time.process_time``), the wall time, and the
Redis CPU the audits took (its process's, from ``/proc``), each per held stream. Divided by the
audit period, that is the share of a core the audit keeps busy.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from loadtest.harness.servers import start_redis
from loadtest.report.summary import print_benchmark
from protocol.streams import StreamCursor
from server.bus.redis_streams import RedisStreams
from server.routing.stream_audit import AUDIT_BATCH, StreamAudit
from server.runtime.metrics import Registry

PERIOD_S = 30.0
"""The default ``--stream-audit-seconds``: what a share of a core is given against."""


class Held:
    """A node's held streams as the audit sees them (``StreamDelivery`` stands
    here): the cursors, the streams it was asked to check, recorded, and those
    whose check is still under way (none unless set)."""

    def __init__(self) -> None:
        self.cursors: dict[str, StreamCursor] = {}
        self.checked: list[str] = []
        self.under_repair: set[str] = set()

    def check(self, stream: str) -> None:
        self.checked.append(stream)

    def repairing(self, stream: str) -> bool:
        return stream in self.under_repair


async def _hold(streams: RedisStreams, held: Held, count: int) -> None:
    async def one(index: int) -> None:
        stream = f"game:audit#{index}"
        position = await streams.append(stream, b"x" * 200, ())
        held.cursors[stream] = StreamCursor(position.epoch, position.offset)

    for start in range(0, count, 1000):
        await asyncio.gather(*(one(i) for i in range(start, min(count, start + 1000))))


async def run(count: int, rounds: int) -> dict[str, Any]:
    redis_proc, redis_url = await start_redis()
    streams = RedisStreams(redis_url)
    try:
        await streams.start()
        held = Held()
        await _hold(streams, held, count)
        audit = StreamAudit(held, streams, Registry(), interval=PERIOD_S)
        await audit.audit({})  # warm up: the read script loaded
        node_us: list[float] = []
        wall_ms: list[float] = []
        redis_us: list[float] = []
        for _ in range(rounds):
            redis_before = redis_proc.cpu()
            cpu_before, wall_before = time.process_time(), time.perf_counter()
            behind = await audit.audit({})
            cpu = time.process_time() - cpu_before
            wall = time.perf_counter() - wall_before
            redis_cpu = redis_proc.cpu() - redis_before
            assert behind == {} and held.checked == [], "every stream is in step"
            node_us.append(round(cpu / count * 1e6, 2))
            wall_ms.append(round(wall * 1000, 1))
            redis_us.append(round(redis_cpu / count * 1e6, 2))
        node = statistics.median(node_us)
        redis = statistics.median(redis_us)
        return {
            "held_streams": count,
            "batch": AUDIT_BATCH,
            "node_cpu_us_per_stream": node_us,
            "audit_wall_ms": wall_ms,
            "redis_cpu_us_per_stream": redis_us,
            "node_core_share_at_30s": round(node * count / 1e6 / PERIOD_S, 5),
            "redis_core_share_at_30s": round(redis * count / 1e6 / PERIOD_S, 5),
        }
    finally:
        await streams.close()
        redis_proc.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.scenarios.stream_audit", description=__doc__
    )
    parser.add_argument("--streams", type=int, default=25_000, help="held streams")
    parser.add_argument("--rounds", type=int, default=3, help="audits timed")
    args = parser.parse_args(argv)
    if args.streams < 1 or args.rounds < 1:
        parser.error("--streams and --rounds must be at least 1")
    results = asyncio.run(run(args.streams, args.rounds))
    print_benchmark(parser.prog, argv, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
