"""Node CPU per DynamoDB call of the store, against moto.

    python -m loadtest.scenarios.store_calls [--calls 2000] [--concurrency 16] [--rounds 3]

A connect costs a cluster node DynamoDB calls an embedded node does not make: its
``wsConnections`` row (``BatchWriteItem``, 25 rows a call) and its user's
``lastSeen`` touch, both through aiobotocore, on the CPU that fans events out
(``loadtest/results/HISTORY.md``, 2026-12-06: an ``UpdateItem`` cost about what
one event's delivery to 100 watchers does). This measures the CPU of this process
(``time.process_time``) per call of the store as the node builds it
(``server.store.dynamodb.DynamoStore``), with ``--concurrency`` callers at once,
in interleaved rounds: a single ``lastSeen`` touch that writes (the conditional
``UpdateItem`` of a first visit), the touches of 25 users with a stale
``lastSeen`` (a ``BatchGetItem`` and a ``BatchExecuteStatement``, as the node
sends them), a ``BatchWriteItem`` of 25 connection rows, and a ``GetItem``.
moto runs in a process of its own: its CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from loadtest.harness.procstat import calls_made, cpu_us_per_call
from loadtest.harness.servers import FAKE_AWS, create_table, start_moto
from loadtest.report.summary import print_benchmark
from loadtest.scenarios.connect_storm import seed_users
from server.store.base import ConnectionRecord
from server.store.dynamodb import DynamoStore

ROWS_PER_BATCH = 25
"""BatchWriteItem's limit, and what the connection-row write-behind sends a call."""

WARMUP_CALLS_PER_CALLER = 10

BATCH_CALLS_DIVISOR = 5
"""A round makes ``--calls`` single-item calls and a fifth as many batch writes (25 rows
each): a round's moto time stays alike."""

Call = Callable[[int], Awaitable[Any]]


def _row(round_id: str, index: int) -> ConnectionRecord:
    return ConnectionRecord(
        connection_id=f"{round_id}-{index}",
        user_id=f"user{index % 500}",
        invisible=False,
        endpoint="node-a",
        wants_presence=True,
        watch_version=1,
        watching_games=frozenset({f"chess#g{index % 200}"}),
        ttl=int(time.time()) + 3600,
    )


async def run(calls: int, concurrency: int, rounds: int) -> dict[str, Any]:
    os.environ.update(FAKE_AWS)
    moto, endpoint = await start_moto()
    try:
        table = f"storecalls-{uuid.uuid4().hex[:8]}"
        await create_table(endpoint, table)
        # Every touch must write: a user of its own, lastSeen long past.
        warmup = concurrency * WARMUP_CALLS_PER_CALLER
        batched = ROWS_PER_BATCH * (warmup + calls // BATCH_CALLS_DIVISOR * rounds)
        users = [f"touch{i}" for i in range(warmup + calls * rounds + batched)]
        await asyncio.to_thread(seed_users, endpoint, table, users)
        store = DynamoStore(table, FAKE_AWS["AWS_DEFAULT_REGION"], endpoint)
        await store.start()
        try:
            return await _measure(store, users, warmup, calls, concurrency, rounds)
        finally:
            await store.close()
    finally:
        moto.stop()


async def _measure(
    store: DynamoStore, users: list[str], warmup: int, calls: int, concurrency: int, rounds: int
) -> dict[str, Any]:
    now_ms = int(time.time() * 1000)
    next_user = 0

    async def touch(_: int) -> None:
        nonlocal next_user
        user = users[next_user]
        next_user += 1
        assert await store.touch_last_seen(user, now_ms), f"{user}'s lastSeen not written"

    async def touch_many(_: int) -> None:
        nonlocal next_user
        batch = users[next_user : next_user + ROWS_PER_BATCH]
        next_user += ROWS_PER_BATCH
        written = await store.touch_last_seen_many(dict.fromkeys(batch, now_ms))
        assert written == set(batch), f"{len(batch) - len(written)} lastSeen not written"

    async def batch_write(index: int) -> None:
        round_id = uuid.uuid4().hex[:6]
        rows = [_row(round_id, index * ROWS_PER_BATCH + i) for i in range(ROWS_PER_BATCH)]
        await store.write_connections(rows, ())

    async def get_item(index: int) -> None:
        await store.get_connection(f"missing-{index}")

    measured: dict[str, tuple[Call, int]] = {
        "UpdateItem (lastSeen, written)": (touch, calls_made(calls, concurrency)),
        f"lastSeen of {ROWS_PER_BATCH} users (BatchGetItem + BatchExecuteStatement)": (
            touch_many,
            calls_made(calls // BATCH_CALLS_DIVISOR, concurrency),
        ),
        f"BatchWriteItem ({ROWS_PER_BATCH} wsConnections rows)": (
            batch_write,
            calls_made(calls // BATCH_CALLS_DIVISOR, concurrency),
        ),
        "GetItem": (get_item, calls_made(calls, concurrency)),
    }
    for call, _ in measured.values():  # warm up: the pool's connections open
        await cpu_us_per_call(call, warmup, concurrency)
    per_round: dict[str, list[float]] = {name: [] for name in measured}
    for _ in range(rounds):
        for name, (call, count) in measured.items():
            cpu = await cpu_us_per_call(call, count, concurrency)
            per_round[name].append(round(cpu, 1))
    return {
        "calls_per_round": {name: count for name, (_, count) in measured.items()},
        "concurrency": concurrency,
        "cpu_us_per_call": per_round,
        "cpu_us_per_call_median": {
            name: statistics.median(values) for name, values in per_round.items()
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.scenarios.store_calls", description=__doc__
    )
    parser.add_argument("--calls", type=int, default=2000, help="single-item calls per round")
    parser.add_argument("--concurrency", type=int, default=16, help="callers at once")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.rounds < 1:
        parser.error("--concurrency and --rounds must be at least 1")
    if args.calls < BATCH_CALLS_DIVISOR * args.concurrency:
        parser.error(
            f"--calls must be at least {BATCH_CALLS_DIVISOR} x --concurrency "
            "(a batch write per caller)"
        )
    results = asyncio.run(run(args.calls, args.concurrency, args.rounds))
    print_benchmark(parser.prog, argv, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
