"""redis-py's ``ClusterPubSub.get_sharded_message`` against our per-shard readers.

    python -m loadtest.scenarios.shard_poll [--messages 300] [--poll-timeout 0.1]

On a local six-instance Redis Cluster, one subscriber listens to channels on
all three shards, and a publisher sends ``--messages`` messages round-robin
over them (shards picked at random), one at a time, each after the previous
one arrived. Printed per
reader: publish -> receive p50/p99/max. Then one primary is frozen (SIGSTOP:
its sockets stay open but nothing answers, the worst case for a poller) and
the same is measured on the two other shards.

redis-py's reader polls the per-shard connections in turn, each with the
timeout given (``timeout=0`` would spin a core), so a message waits for the
quiet shards polled before it; ours (``server/bus/redis_cluster_bus.py``)
reads every shard in its own task.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot

from loadtest.harness.redis_cluster import RedisCluster, start_redis_cluster
from loadtest.report.summary import print_benchmark
from server.bus.redis_cluster_bus import RedisClusterBus
from server.redis.client import make_cluster_client

Receive = Callable[[], Awaitable[str | None]]
Closer = Callable[[], Awaitable[None]]


def channels_per_shard(cluster: RedisCluster) -> dict[int, str]:
    found: dict[int, str] = {}
    i = 0
    while len(found) < 3:
        channel = f"ap:{{bench:{i}}}"
        found.setdefault(cluster.owner(key_slot(channel.encode())), channel)
        i += 1
    return found


async def _round_trips(
    publisher: ClusterClient, channels: Sequence[str], receive: Receive, count: int, limit: float
) -> list[float]:
    """Seconds from SPUBLISH to arrival, one message at a time; NaN when it never came."""
    out: list[float] = []
    rng = random.Random(count)  # not in step with redis-py's round robin over shards
    for i in range(count):
        channel = rng.choice(channels)
        token = f"{i}"
        sent = time.perf_counter()
        await publisher.spublish(channel, token)
        deadline = sent + limit
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                out.append(float("nan"))
                break
            try:
                got = await asyncio.wait_for(receive(), remaining)
            except TimeoutError:
                continue
            if got == token:
                out.append(time.perf_counter() - sent)
                break
    return out


def _summary(values: list[float]) -> dict[str, float]:
    ok = sorted(v for v in values if v == v)
    if not ok:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan"), "lost": 0}
    p99 = ok[min(len(ok) - 1, int(len(ok) * 0.99))]
    return {
        "p50_ms": round(statistics.median(ok) * 1000, 2),
        "p99_ms": round(p99 * 1000, 2),
        "max_ms": round(ok[-1] * 1000, 2),
        "lost": len(values) - len(ok),
    }


async def redis_py_reader(
    cluster: RedisCluster, channels: list[str], poll_timeout: float
) -> tuple[Receive, Callable[[], Awaitable[None]]]:
    client = make_cluster_client(cluster.url)
    await client.initialize()
    pubsub = client.pubsub()
    for channel in channels:
        await pubsub.ssubscribe(channel)

    async def receive() -> str | None:
        while True:
            try:
                message = await pubsub.get_sharded_message(
                    ignore_subscribe_messages=True, timeout=poll_timeout
                )
            except Exception:  # a frozen or failed-over shard: keep reading the others
                await asyncio.sleep(0.01)
                continue
            if message is not None and message["type"] == "smessage":
                return str(message["data"].decode())

    async def close() -> None:
        await pubsub.aclose()
        await client.aclose()

    return receive, close


async def our_reader(
    cluster: RedisCluster, channels: list[str]
) -> tuple[Receive, Callable[[], Awaitable[None]]]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    bus = RedisClusterBus(cluster.url)
    await bus.start(lambda topic, data: queue.put_nowait(data.decode()))
    # channel_for wraps a topic in ap:{...}: subscribe by the topic inside.
    await bus.subscribe([c[len("ap:{") : -1] for c in channels])

    async def receive() -> str | None:
        return await queue.get()

    return receive, bus.close


async def run(messages: int, poll_timeout: float) -> dict[str, Any]:
    cluster = await asyncio.to_thread(start_redis_cluster)
    try:
        publisher = make_cluster_client(cluster.url)
        await publisher.initialize()
        results: dict[str, Any] = {"poll_timeout_s": poll_timeout, "messages": messages}
        channels: list[str] = []
        readers: dict[str, Callable[[], Awaitable[tuple[Receive, Closer]]]] = {
            "redis-py get_sharded_message": lambda: redis_py_reader(
                cluster, channels, poll_timeout
            ),
            "per-shard readers (ours)": lambda: our_reader(cluster, channels),
        }
        for name, make in readers.items():
            # A freeze longer than the node timeout fails the shard over: map again.
            await asyncio.to_thread(cluster.wait_ok)
            by_shard = channels_per_shard(cluster)
            channels[:] = list(by_shard.values())
            receive, close = await make()
            try:
                healthy = await _round_trips(publisher, channels, receive, messages, 5.0)
                frozen_port, frozen_channel = next(iter(by_shard.items()))
                others = [c for c in channels if c != frozen_channel]
                process = cluster.instance(frozen_port).process
                assert process is not None
                process.send_signal(signal.SIGSTOP)
                try:
                    stalled = await _round_trips(publisher, others, receive, messages // 3, 5.0)
                finally:
                    process.send_signal(signal.SIGCONT)
                await asyncio.sleep(1.0)
            finally:
                await close()
            results[name] = {
                "healthy": _summary(healthy),
                "one_shard_frozen": _summary(stalled),
            }
        await publisher.aclose()
        return results
    finally:
        cluster.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.scenarios.shard_poll", description=__doc__
    )
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument(
        "--poll-timeout", type=float, default=0.1, help="redis-py's per-shard poll timeout (s)"
    )
    args = parser.parse_args(argv)
    results = asyncio.run(run(args.messages, args.poll_timeout))
    print_benchmark(parser.prog, argv, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
