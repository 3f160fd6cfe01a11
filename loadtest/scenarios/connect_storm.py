"""The ``connect`` scenario: fan-out during and right after a connect storm, cluster
mode against embedded, in the same run.

A connect costs a cluster node writes an embedded one does not make: the
``wsConnections`` row, the ``USERS.lastSeen`` touch (a Redis claim and a
DynamoDB write per user, every user here having a stale ``lastSeen``), the
presence report. This measures what they take from fan-out while they drain.

- One embedded node (``ours``) and one cluster node (``cluster``: Redis and a
  DynamoDB table on moto, every user of the run seeded with a ``USERS`` row whose
  ``lastSeen`` is long past).
- Each round, for each node in turn (the order alternates between rounds):
  once both nodes are idle (a phase's leftover writes done),
  ``--connections`` new users connect (fresh ids: no claim left from a round
  before), and at once the closed-loop publishing phase starts
  (``--saturation-seconds``), its deliveries drained; then every client closes.
- With ``--rate R`` each phase publishes R events/s for ``--duration`` seconds
  instead: both modes at the same load, so the ratio is their CPU per frame
  without the closed loop's batching (a cluster node's publishes wait for
  Redis, so fewer of them share its flushes). Reported, not judged: the
  target is set on the closed loop.
- The figure: delivered messages per server CPU-second of the phase, cluster ÷
  embedded, the median of the per-round ratios. The cluster node's
  ``lastSeen`` counters show how many writes the phase overlapped; each
  node's frames per socket write, flushes and flushes held by
  ``--write-delay-ms`` (from its ``/metrics``, over the connect and the phase)
  show what the write delay did there.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import uuid
from typing import Any

import boto3

from loadtest.clients.publisher import Publisher
from loadtest.harness.runner import (
    Run,
    browser_specs,
    game_refs,
    http_endpoint,
    merge_latency,
    ws_endpoint,
)
from loadtest.harness.servers import (
    FAKE_AWS,
    Proc,
    create_table,
    start_moto,
    start_ours,
    start_redis,
)
from loadtest.report.stats import Histogram, ratio
from loadtest.report.targets import Target, check
from loadtest.scenarios.abuse import run_metrics
from loadtest.scenarios.core import SATURATE, _phase, _publish_phase

Result = dict[str, Any]

LABELS = ("ours", "cluster")
NAMES = {"ours": "embedded node", "cluster": "cluster node"}
TARGET = Target(
    "connect",
    "cluster mode during and right after a connect, delivered per server CPU-s / embedded",
    "x",
    ">=",
    0.95,
    ("connections", 2000),
)


def _user_prefix(number: int, label: str) -> str:
    return f"r{number}{label[0]}-u"


def seed_users(endpoint: str, table: str, users: list[str]) -> None:
    """``USERS`` rows with a ``lastSeen`` long past: each connect must write it."""
    client = boto3.resource(
        "dynamodb",
        endpoint_url=endpoint,
        region_name=FAKE_AWS["AWS_DEFAULT_REGION"],
        aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
    ).Table(table)
    with client.batch_writer() as batch:
        for user in users:
            batch.put_item(Item={"pk": "USERS", "sk": user, "name": user, "lastSeen": 1})


async def connect_storm(run: Run) -> Result:
    options = run.options
    games = game_refs(options.games)
    count = options.connections
    rounds = options.rounds or 3
    run.progress.log("starting redis-server and moto_server")
    redis_proc, redis_url = await start_redis()
    run.track(redis_proc)
    moto_proc, endpoint = await start_moto()
    run.procs.append(moto_proc)  # moto stands in for DynamoDB: not under test
    table = f"loadtest-{uuid.uuid4().hex[:8]}"
    await create_table(endpoint, table)
    users = [f"{_user_prefix(n, 'cluster')}{i}" for n in range(rounds) for i in range(count)]
    await asyncio.to_thread(seed_users, endpoint, table, users)
    run.progress.log(f"seeded {len(users)} USERS rows with a stale lastSeen")
    targets: dict[str, Proc] = {"ours": await run.start_server("ours")}
    node = await start_ours(
        "cluster-1",
        run.secrets,
        debounce_ms=options.debounce_ms,
        extra_args=options.server_args,
        cluster=(redis_url, endpoint, table),
    )
    targets["cluster"] = run.track(node)
    run.add_server("cluster", [node])
    run.add_server("redis", [redis_proc])
    records: dict[str, list[Result]] = {label: [] for label in LABELS}
    expected = 0
    for number in range(rounds):
        order = LABELS if number % 2 == 0 else LABELS[::-1]
        for label in order:
            proc = targets[label]
            specs, watchers = browser_specs(
                count,
                games,
                options.games_per_conn,
                0.0,  # browsers only: a bot's id carries no round prefix
                run.rng,
                prefix=_user_prefix(number, label),
            )
            # A phase's leftover write-behind (a cluster node's lastSeen writes, for
            # many seconds) must not run in the next phase, on either node.
            settled_s = sum([await run.settle(node) for node in LABELS])
            before_metrics = await run_metrics(proc)
            run.activate(label, "connect")
            await run.connect(
                specs,
                [ws_endpoint(proc)],
                label=f"{label}: round {number + 1}, connecting",
                concurrency=options.ramp,
            )
            publisher = Publisher(
                [http_endpoint(proc)],
                run.secrets.publish,
                games,
                watchers,
                options.publishers,
                seed=options.seed + number,
            )
            phase_id = number * 100 + LABELS.index(label) * 10 + SATURATE
            try:
                stats, meters = await _publish_phase(
                    run, label, publisher, phase_id, options.rate, expected
                )
            finally:
                publisher.close()
            expected += stats.expected_deliveries
            latency = merge_latency(await run.collect(run.observer_workers))
            record = _phase(stats, latency.get(phase_id, Histogram()), *meters)
            record["round"] = number + 1
            record["settled_s"] = round(settled_s, 1)
            after = await run_metrics(proc)
            # what the flush rule did: frames per socket write, flushes held by the delay
            record["frames_per_write"] = ratio(
                _delta(before_metrics, after, "ap_frames_sent_total"),
                _delta(before_metrics, after, "ap_socket_writes_total"),
            )
            record["flushes"] = _delta(before_metrics, after, "ap_write_flushes_total")
            record["flushes_held"] = _delta(before_metrics, after, "ap_write_flushes_held_total")
            if label == "cluster":
                record["last_seen_writes"] = _delta(
                    before_metrics, after, "ap_last_seen_writes_total"
                )
                record["last_seen_requests"] = _delta(
                    before_metrics, after, "ap_last_seen_requests_total"
                )
            records[label].append(record)
            await run.pool.broadcast({"op": "close_all"}, limit=30)
            # the closes' presence leaves and row deletes drain before the next phase
            await run.wait_timed("closing", options.debounce_ms / 1000 * 2 + 2.0)
    await run.stop_servers("ours", "cluster", "redis")
    per_round = [
        ratio(c["delivered_per_cpu_s"], o["delivered_per_cpu_s"])
        for c, o in zip(records["cluster"], records["ours"], strict=True)
    ]
    numbers = [v for v in per_round if not math.isnan(v)]
    median = round(statistics.median(numbers), 3) if numbers else math.nan
    figures = {
        NAMES[label]: {
            "connect_rounds": records[label],
            "delivered_per_cpu_s": statistics.median(
                r["delivered_per_cpu_s"] for r in records[label]
            ),
        }
        for label in LABELS
    }
    return {
        "servers": figures,
        "ratios": {
            "cluster_over_embedded_delivered_per_cpu_s": median,
            "per_round": [round(v, 3) for v in per_round],
        },
        # The target is set on the closed loop; a fixed rate is the same comparison
        # at equal load, reported beside it, not judged.
        "targets": []
        if options.rate is not None
        else [check(TARGET, median, count, note=f"median of the per-round ratios {per_round}")],
    }


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)
