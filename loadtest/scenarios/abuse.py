"""``abuse`` and ``churn``: a node under attack while normal clients are served.

``abuse`` connects N normal browsers, then runs each attack of
:mod:`loadtest.clients.attacks` in turn while publishing game events at a steady
rate; per attack it reports the normal clients' publish -> receive latency,
lost deliveries, the server's RSS, and how every attacker's connection ended.
Valid publishes with bodies split across TCP writes run beside the attacks.

``churn`` connects and closes rounds of subscribed clients and reports how
much of the server's memory stays behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from typing import Any

from loadtest.clients.attacks import ATTACKS, Attack, AttackContext, Attacker, split_post
from loadtest.clients.publisher import Publisher
from loadtest.clients.sim import ClientSpec
from loadtest.harness.procstat import rss_bytes
from loadtest.harness.runner import (
    Run,
    browser_specs,
    game_refs,
    http_endpoint,
    merge_latency,
    ws_endpoint,
)
from loadtest.harness.servers import HOST, Proc
from loadtest.harness.worker import mint_token
from loadtest.report.stats import Histogram
from loadtest.report.targets import Target, check

Result = dict[str, Any]
MIB = 1024 * 1024
SPLIT_PHASE_OFFSET = 50  # split-body publishes: counted for loss, kept out of the p99


class RssWatch:
    """Samples a process's RSS in the background; the peak since the last reset."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_bytes(self.proc.pid))
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def abuse(run: Run) -> Result:
    options = run.options
    games = game_refs(options.games)
    specs, watchers = browser_specs(
        options.connections, games, options.games_per_conn, options.bots, run.rng
    )
    proc = await run.start_server("ours")
    await asyncio.sleep(0.5)
    rss_empty = await run.rss_settled("ours")
    run.activate("ours", "connect")
    await run.connect(
        specs, [ws_endpoint(proc)], label="ours: connecting", concurrency=options.ramp
    )
    run.activate("ours", "settle")
    await run.settle_watch()
    rss_start = await run.rss_settled("ours")
    history_start = (await run_metrics(proc)).get(HISTORY_BYTES, 0.0)
    publisher = Publisher(
        [http_endpoint(proc)], run.secrets.publish, games, watchers, 4, seed=options.seed
    )
    publisher.pad = "x" * options.abuse_pad
    rate = options.rate or 100.0
    watch = RssWatch(proc)
    watch.start()
    expected = 0
    phases: list[Result] = []
    context = AttackContext(
        host=HOST,
        port=proc.ws_port,
        http=http_endpoint(proc),
        publish_secret=run.secrets.publish,
        token_for=lambda user: mint_token(run.secrets.jwt, user),
        count=0,
        seconds=0.0,
        games=games,
        rng=run.rng,
    )
    try:
        chosen = [a for a in ATTACKS if not options.attacks or a.name in options.attacks]
        for number, attack in enumerate(chosen, start=1):
            seconds = attack.seconds * options.duration / 4.0
            extra = attack.count - attack.open_allowed  # the cap's admitted ones stay
            context.count = attack.open_allowed + max(1, round(extra * options.attackers))
            context.seconds = seconds
            run.progress.log(
                f"attack {attack.name}: {context.count} x {attack.description}, "
                f"{rate:g} publishes/s for {seconds:g} s"
            )
            run.activate("ours", attack.name)
            metrics_before = await run_metrics(proc)
            watch.peak = 0
            before = run.meter()
            stats, attackers, split = await asyncio.gather(
                publisher.fixed_rate(number, rate, seconds),
                attack.run(context),
                _split_publishes(context, publisher, games, watchers, number, seconds),
            )
            window = run.interval(before, run.meter(), "ours")
            await asyncio.gather(*(a.finish(attack.grace) for a in attackers))
            expected += stats.expected_deliveries + split["expected"]
            await run.drain(expected)
            metrics_after = await run_metrics(proc)
            phases.append(
                {
                    "attack": attack.name,
                    "description": attack.description,
                    "attackers": len(attackers),
                    "publishes": stats.accepted,
                    "publish_failures": stats.failed,
                    "late_publishes": stats.late,
                    "server_cores": window["server_cores"],
                    "generator_busiest_process": window["generator_busiest_process"],
                    "expected": stats.expected_deliveries,
                    "split_publishes": split["accepted"],
                    "split_failures": split["failed"],
                    "split_expected": split["expected"],
                    "rss_peak_bytes": watch.peak,
                    "server_counters": {
                        name: metrics_after.get(name, 0) - metrics_before.get(name, 0)
                        for name in WATCHED_METRICS
                    },
                    **_judge(attack, attackers, context),
                }
            )
            for attacker in attackers:
                attacker.abort()
        results = await run.collect(run.observer_workers)
        latency = merge_latency(results)
        for number, phase in enumerate(phases, start=1):
            histogram = latency.get(number, Histogram())
            split_histogram = latency.get(number + SPLIT_PHASE_OFFSET, Histogram())
            phase["delivered"] = histogram.count
            phase["lost"] = phase["expected"] - histogram.count
            phase["split_lost"] = phase["split_expected"] - split_histogram.count
            phase["latency"] = histogram.summary_ms()
    finally:
        watch.stop()
        publisher.close()
    run.activate("ours", "after")
    await run.wait_timed("after the attacks", 3.0)
    rss_end = await run.rss_settled("ours")
    history_growth = (await run_metrics(proc)).get(HISTORY_BYTES, 0.0) - history_start
    await run.stop_servers("ours")
    peak = max(p["rss_peak_bytes"] for p in phases)
    figures: Result = {
        "normal_clients": len(specs),
        "rate": rate,
        "rss_empty_bytes": rss_empty,
        "rss_start_bytes": rss_start,
        "rss_peak_bytes": peak,
        "rss_end_bytes": rss_end,
        "rss_growth_during_mib": round((peak - rss_start) / MIB, 1),
        "rss_growth_after_mib": round((rss_end - rss_start) / MIB, 1),
        # The normal clients' events fill their games' histories, a cache by
        # design (--history-size events per stream, for --history-ttl): the
        # server reports its bytes, and what is left is what the run left behind.
        "stream_history_growth_mib": round(history_growth / MIB, 1),
        "rss_growth_after_beyond_history_mib": round(
            (rss_end - rss_start - history_growth) / MIB, 1
        ),
        "attacks": phases,
        "lost": sum(p["lost"] + p["split_lost"] for p in phases),
        "worst_p99_ms": max(p["latency"]["p99_ms"] for p in phases),
        "attackers_wrongly_ended": sum(p["wrong"] for p in phases),
    }
    size = ("normal clients", 1000)
    targets = [
        check(
            Target("abuse", "normal clients' p99 during the worst attack", "ms", "<=", 50.0, size),
            figures["worst_p99_ms"],
            len(specs),
        ),
        check(
            Target("abuse", "RSS growth during the run", "MiB", "<=", 100.0, size),
            figures["rss_growth_during_mib"],
            len(specs),
        ),
        check(
            Target(
                "abuse", "RSS growth after the run, beyond stream history", "MiB", "<=", 10.0, size
            ),
            figures["rss_growth_after_beyond_history_mib"],
            len(specs),
        ),
        check(Target("abuse", "valid publishes lost", "", "<=", 0), figures["lost"], len(specs)),
        check(
            Target("abuse", "attackers not closed with the documented code", "", "<=", 0),
            figures["attackers_wrongly_ended"],
            len(specs),
        ),
    ]
    return {"servers": {"ours": figures}, "targets": targets}


HISTORY_BYTES = "ap_stream_history_bytes"
WATCHED_METRICS = (
    "ap_flood_closes_total",
    "ap_slow_consumers_total",
    "ap_refused_upgrades_total",
    "ap_client_errors_total",
    "ap_gc_pause_seconds_total",
    "ap_gc_long_pauses_total",
    "ap_gc_full_collections_total",
    "ap_loop_stalls_total",
    "ap_loop_stall_seconds_total",
    "ap_loop_busy_stalls_total",
)


async def run_metrics(proc: Proc) -> dict[str, float]:
    """The server's counters from ``GET /metrics``."""
    reader, writer = await asyncio.open_connection(HOST, proc.http_port)
    try:
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        text = (await asyncio.wait_for(reader.read(), 10)).decode()
    finally:
        writer.close()
    values: dict[str, float] = {}
    for line in text.split("\r\n\r\n", 1)[-1].splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    return values


def _judge(attack: Attack, attackers: list[Attacker], ctx: AttackContext) -> Result:
    """How each attacker ended, and how many ended in a way the docs do not promise."""
    outcomes = Counter(attack.outcome(a) for a in attackers)
    allowed_open = min(attack.open_allowed, len(attackers))
    wrong = sum(n for outcome, n in outcomes.items() if outcome not in attack.expected)
    wrong -= min(allowed_open, outcomes.get("open", 0))
    if allowed_open and outcomes.get("open", 0) != allowed_open:
        wrong += abs(outcomes.get("open", 0) - allowed_open)
    result: Result = {
        "expected_outcomes": list(attack.expected),
        "outcomes": dict(outcomes),
        "wrong": max(0, wrong),
        "rate_limited_errors": sum("rate_limited" in a.errors for a in attackers),
    }
    if attack.name == "odd_game_ids":
        statuses = ctx.notes.get("odd_publish_statuses", [])
        result["odd_publish_statuses"] = statuses
        result["wrong"] += sum(status != 400 for status in statuses)
    return result


async def _split_publishes(
    ctx: AttackContext,
    publisher: Publisher,
    games: list[tuple[str, str]],
    watchers: list[int],
    number: int,
    seconds: float,
) -> dict[str, int]:
    """Valid ~60 KB publishes, each body in two writes 100 ms apart, both framings."""
    accepted = failed = expected = 0
    end = time.monotonic() + seconds
    index = 0
    while time.monotonic() < end:
        game = ctx.rng.randrange(len(games))
        meta, game_id = games[game]
        payload = {
            "meta": meta,
            "id": game_id,
            "ts": time.time_ns(),
            "ph": number + SPLIT_PHASE_OFFSET,
            "big": "y" * 60_000,
        }
        body = json.dumps({"verb": "game", "payload": payload}, separators=(",", ":")).encode()
        try:
            status = await split_post(ctx, body, chunked=index % 2 == 1, pause=0.1)
        except (OSError, TimeoutError, ValueError, IndexError):
            status = 0
        if status == 202:
            accepted += 1
            expected += watchers[game]
        else:
            failed += 1
        index += 1
        await asyncio.sleep(0.4)
    return {"accepted": accepted, "failed": failed, "expected": expected}


# --- churn ------------------------------------------------------------------------


async def churn(run: Run) -> Result:
    """Rounds of N connect/subscribe/close: server memory before, during and after."""
    options = run.options
    proc = await run.start_server("ours")
    await asyncio.sleep(0.5)
    rounds = options.rounds
    per_round = options.connections
    samples: list[int] = []
    rss_start = 0
    for number in range(rounds + 1):
        specs = [
            ClientSpec(user_id=f"c{number}-{i}", games=(("loadtest", f"g{i % 50}"),))
            for i in range(per_round)
        ]
        run.activate("ours", "connect")
        await run.connect(
            specs, [ws_endpoint(proc)], label=f"round {number}", concurrency=options.ramp
        )
        await run.pool.broadcast({"op": "close_all"}, limit=30)
        run.activate("ours", "settle")
        await asyncio.sleep(0.5)
        rss = await run.rss_settled("ours")
        if number == 0:
            rss_start = rss  # after one warm-up round: first-use allocations are in
        else:
            samples.append(rss)
        run.progress.log(f"round {number}: RSS {rss / MIB:.1f} MiB")
    await run.wait_timed("after the rounds", 2.0)
    rss_end = await run.rss_settled("ours")
    metrics = await run_metrics(proc)
    await run.stop_servers("ours")
    count = metrics.get("ap_memory_reclaims_total", 0.0)
    spent = metrics.get("ap_memory_reclaim_seconds_total", 0.0)
    figures: Result = {
        "rounds": rounds,
        "connections_per_round": per_round,
        "rss_start_bytes": rss_start,
        "rss_per_round_mib": [round((s - rss_start) / MIB, 1) for s in samples],
        "rss_peak_growth_mib": round((max(samples, default=rss_start) - rss_start) / MIB, 1),
        "rss_growth_after_mib": round((rss_end - rss_start) / MIB, 1),
        "reclaims": int(count),
        "reclaim_pause_mean_ms": round(spent / count * 1000, 2) if count else 0.0,
        "reclaim_pause_max_ms": round(
            metrics.get("ap_memory_reclaim_longest_seconds", 0) * 1000, 2
        ),
    }
    targets = [
        check(
            Target("churn", "RSS growth after the rounds", "MiB", "<=", 10.0, ("rounds", 20)),
            figures["rss_growth_after_mib"],
            rounds,
        )
    ]
    return {"servers": {"ours": figures}, "targets": targets}
