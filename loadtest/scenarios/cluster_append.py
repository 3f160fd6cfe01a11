"""Node CPU per game-event publish: one Redis against a Redis Cluster, in-process.

    python -m loadtest.scenarios.cluster_append [--events 4000] [--concurrency 16] [--rounds 3]

A game event is what ``Node.publish`` hands to the streams: one ``APPEND``
on the game's stream, published on the game's channel and on ``ap:{games}``
(legacy clients). On one Redis that is one script; on a cluster the
``ap:{games}`` publish is a second command on another slot. This measures the
CPU of this process (``time.process_time``) per appended event, with
``--concurrency`` publishers at once over 200 games, in interleaved rounds on a
local ``redis-server`` and a local six-instance cluster, both started here.
The receive side is not measured (it is the same on both).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Sequence
from typing import Any

from loadtest.harness.procstat import cpu_us_per_call
from loadtest.harness.redis_cluster import start_redis_cluster
from loadtest.harness.servers import start_redis
from loadtest.report.summary import print_benchmark
from server.bus.redis_cluster_bus import RedisClusterBus
from server.bus.redis_streams import RedisStreams
from server.bus.topics import ALL_GAMES

GAMES = 200


async def _cpu_per_event(streams: RedisStreams, events: int, concurrency: int) -> float:
    """Microseconds of this process's CPU per appended game event."""
    body = b"x" * 200

    async def publish(index: int) -> None:
        game = f"game:bench#{index % GAMES}"
        await streams.append(game, body, (game, ALL_GAMES))

    return await cpu_us_per_call(publish, events, concurrency)


async def run(events: int, concurrency: int, rounds: int) -> dict[str, Any]:
    redis_proc, redis_url = await start_redis()
    cluster = await asyncio.to_thread(start_redis_cluster)
    bus = RedisClusterBus(cluster.url)
    try:
        await bus.start(lambda topic, data: None)
        one = RedisStreams(redis_url)
        sharded = RedisStreams.on_cluster(bus)
        await one.start()
        await sharded.start()
        setups = {"one Redis": one, "Redis Cluster": sharded}
        for streams in setups.values():  # warm up: scripts loaded, connections open
            await _cpu_per_event(streams, concurrency * 20, concurrency)
        per_round: dict[str, list[float]] = {name: [] for name in setups}
        for _ in range(rounds):
            for name, streams in setups.items():
                per_round[name].append(round(await _cpu_per_event(streams, events, concurrency), 1))
        await one.close()
        await sharded.close()
        ratios = [
            round(c / o, 3)
            for o, c in zip(per_round["one Redis"], per_round["Redis Cluster"], strict=True)
        ]
        return {
            "events_per_round": events,
            "concurrency": concurrency,
            "cpu_us_per_event": per_round,
            "cluster_over_one_per_round": ratios,
            "cluster_over_one_median": statistics.median(ratios),
        }
    finally:
        await bus.close()
        cluster.stop()
        redis_proc.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.scenarios.cluster_append", description=__doc__
    )
    parser.add_argument("--events", type=int, default=4000, help="events per round and setup")
    parser.add_argument("--concurrency", type=int, default=16, help="publishers at once")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    results = asyncio.run(run(args.events, args.concurrency, args.rounds))
    print_benchmark(parser.prog, argv, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
