"""The scenarios: idle, fanout, presence, storm, cluster, baseline and bots (``bots.py``).

Each returns a JSON-ready dict: per server (``baseline``, ``ours``, or the
cluster) its figures, the ratios of ours to the baseline measured in the
same run, the targets with pass/short, and the data behind the plots.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from loadtest.clients.publisher import Publisher, PublishStats
from loadtest.clients.sim import ClientSpec
from loadtest.harness.floor import Floor, FloorRun
from loadtest.harness.pool import WorkerError
from loadtest.harness.procstat import somaxconn, tcp_counters
from loadtest.harness.redis_cluster import start_redis_cluster
from loadtest.harness.runner import (
    Options,
    Run,
    browser_specs,
    failures_by_cause,
    game_refs,
    http_endpoint,
    merge_counters,
    merge_latency,
    ws_endpoint,
)
from loadtest.harness.servers import Proc, create_table, start_moto, start_ours, start_redis
from loadtest.report.stats import Histogram, mean_of, ratio, seconds_summary
from loadtest.report.targets import Target, check
from loadtest.scenarios.abuse import abuse, churn, run_metrics
from loadtest.scenarios.bots import bots as bots_published
from loadtest.scenarios.bots_queue import bots_queue
from loadtest.scenarios.failover import measure as measure_failover
from loadtest.scenarios.streammem import streammem

Result = dict[str, Any]

SATURATE, STEADY = 1, 2
WARMUP = 9  # a phase id no round uses


def _kib(value: float) -> float:
    return round(value / 1024, 2)


def _servers(options: Options) -> list[str]:
    return ["baseline", "ours"] if options.baseline else ["ours"]


# --- connecting and memory ----------------------------------------------------


async def connect_measured(
    run: Run, label: str, procs: Sequence[Proc], specs: Sequence[ClientSpec]
) -> Result:
    """Connect ``specs`` to a server, ramped, and measure its RSS before and after."""
    await asyncio.sleep(0.5)
    rss_before = await run.rss_settled(label)
    run.activate(label, "connect")
    start = run.meter()
    await run.connect(
        specs,
        [ws_endpoint(p) for p in procs],
        label=f"{label}: connecting",
        concurrency=run.options.ramp,
    )
    connected = run.meter()
    run.activate(label, "settle")
    await run.settle_watch()
    rss_after = await run.rss_settled(label)
    await run.pool.fresh_ticks()
    subscribed = run.pool.total("subscribed") - run.base_subscribed
    return {
        "connections": len(specs),
        "subscribed": subscribed,
        "rss_before_bytes": rss_before,
        "rss_after_bytes": rss_after,
        "rss_per_connection_kib": _kib((rss_after - rss_before) / max(1, subscribed)),
        "connect": run.interval(start, connected, label),
    }


# --- idle ---------------------------------------------------------------------


async def idle(run: Run) -> Result:
    """N subscribed browsers that only sit there: resident memory per connection."""
    options = run.options
    games = game_refs(options.games)
    specs, _ = browser_specs(
        options.connections, games, options.games_per_conn, options.bots, run.rng
    )
    servers: dict[str, Any] = {}
    for kind in _servers(options):
        proc = await run.start_server(kind)
        figures = await connect_measured(run, kind, [proc], specs)
        run.activate(kind, "idle")
        await run.wait_timed(f"{kind}: idle", options.duration)
        figures["rss_after_idle_bytes"] = await run.rss_settled(kind)
        figures["counters"] = merge_counters(await run.collect(run.observer_workers))
        servers[kind] = figures
        await run.stop_servers(kind)
    result: Result = {"servers": servers}
    if "baseline" in servers:
        result["ratios"] = {
            "rss_per_connection": ratio(
                servers["ours"]["rss_per_connection_kib"],
                servers["baseline"]["rss_per_connection_kib"],
            )
        }
    result["targets"] = [
        check(
            Target(
                "idle", "RSS per subscribed connection", "KiB", "<=", 20.0, ("connections", 10000)
            ),
            servers["ours"]["rss_per_connection_kib"],
            options.connections,
        )
    ]
    return result


# --- fanout -------------------------------------------------------------------


async def fanout(run: Run) -> Result:
    """N clients watching M games: saturate, then publish at half that rate."""
    options = run.options
    games = game_refs(options.games)
    specs, watchers = browser_specs(
        options.connections, games, options.games_per_conn, options.bots, run.rng
    )
    targets: dict[str, list[Proc]] = {}
    for kind in _servers(options):
        targets[kind] = [await run.start_server(kind)]
    floor = c_floor(run, specs, games)
    try:
        servers = await fanout_compare(run, targets, specs, games, watchers, floor=floor)
    finally:
        floor.close()
    await run.stop_servers(*targets)
    # beside the servers: it is no server, and has no latency or steady phase
    floor_figures = servers.pop("floor")
    result: Result = {
        "servers": servers,
        "floor": floor_figures,
        "watchers_per_game": mean_of(watchers),
    }
    # issue 8: the streams must keep fan-out at least as cheap as the baseline
    result.update(
        _fanout_verdicts(options, servers, "ours", "fanout", ratio_limit=1.0, floor=floor_figures)
    )
    return result


def c_floor(run: Run, specs: Sequence[ClientSpec], games: Sequence[tuple[str, str]]) -> Floor:
    """The C send() loop over as many sockets as ``specs``, each watching its spec's games."""
    where = {game: index for index, game in enumerate(games)}
    return Floor(
        len(specs),
        games,
        [[where[game] for game in spec.games] for spec in specs],
        sorted(run.server_cpus),
        sorted(run.generator_cpus),
    )


async def baseline(run: Run) -> Result:
    """The fanout measurement of the baseline server alone."""
    options = run.options
    games = game_refs(options.games)
    specs, watchers = browser_specs(
        options.connections, games, options.games_per_conn, options.bots, run.rng
    )
    proc = await run.start_server("baseline")
    servers = await fanout_compare(run, {"baseline": [proc]}, specs, games, watchers)
    await run.stop_servers("baseline")
    return {"servers": servers, "watchers_per_game": mean_of(watchers), "targets": []}


async def fanout_compare(
    run: Run,
    targets: dict[str, list[Proc]],
    specs: Sequence[ClientSpec],
    games: Sequence[tuple[str, str]],
    watchers: Sequence[int],
    *,
    floor: Floor | None = None,
) -> dict[str, Result]:
    """Measure every server in ``targets`` with the same clients, phases interleaved.

    All servers hold their own copy of the clients at once. Each round runs
    a closed-loop saturation phase on each server in turn, then a phase at
    half of each server's own saturating rate; the order alternates between
    rounds, so drifting noise on a shared machine hits every server alike.
    The headline figures are medians over the rounds.

    With ``floor``, each round also runs the C ``send()`` loop for as long as
    a saturation phase, at the publish rate the last server under test
    reached in that round: same frames, same sockets, same rate (``floor``).
    """
    options = run.options
    labels = list(targets)
    floor_rounds: list[Result] = []
    out: dict[str, Result] = {}
    for label in labels:
        out[label] = await connect_measured(run, label, targets[label], specs)
    publishers = {
        label: Publisher(
            [http_endpoint(p) for p in targets[label]],
            run.secrets.publish,
            games,
            watchers,
            options.publishers,
            seed=options.seed,
        )
        for label in labels
    }
    rounds: dict[str, list[Result]] = {label: [] for label in labels}
    expected = 0
    try:
        if options.warmup_seconds > 0:
            for label in labels:
                # unmeasured: first-use allocations and page faults land here
                run.progress.log(f"{label}: warming up for {options.warmup_seconds:g} s")
                run.activate(label, "warmup")
                stats = await publishers[label].closed_loop(WARMUP, options.warmup_seconds)
                expected += stats.expected_deliveries
                await run.drain(expected)
        for number in range(options.rounds):
            order = labels if number % 2 == 0 else labels[::-1]
            rates: dict[str, float] = {}
            saturating: dict[str, float] = {}
            phases: dict[str, dict[str, Any]] = {label: {} for label in labels}
            for label in order:
                phase_id = _phase_id(number, labels.index(label), SATURATE)
                stats, meters = await _publish_phase(
                    run, label, publishers[label], phase_id, None, expected
                )
                expected += stats.expected_deliveries
                phases[label]["saturate"] = (stats, meters)
                saturating[label] = max(1.0, stats.accepted / stats.duration)
                rates[label] = options.rate or saturating[label] / 2
            if floor is not None:
                paced_by = next(label for label in labels if label != "baseline")
                floor_rounds.append(await _floor_phase(run, floor, saturating[paced_by]))
            for label in order:
                phase_id = _phase_id(number, labels.index(label), STEADY)
                stats, meters = await _publish_phase(
                    run, label, publishers[label], phase_id, rates[label], expected
                )
                expected += stats.expected_deliveries
                phases[label]["steady"] = (stats, meters)
            results = await run.collect(run.observer_workers)
            latency = merge_latency(results)
            for label in labels:
                index = labels.index(label)
                record: Result = {"round": number + 1}
                for name, kind in (("saturate", SATURATE), ("steady", STEADY)):
                    stats, meters = phases[label][name]
                    histogram = latency.get(_phase_id(number, index, kind), Histogram())
                    record[name] = _phase(stats, histogram, *meters)
                    record[name]["_histogram"] = histogram
                record["steady"]["target_rate"] = round(rates[label], 1)
                rounds[label].append(record)
    finally:
        for publisher in publishers.values():
            publisher.close()
    results = await run.collect(run.observer_workers)
    counters = merge_counters(results)
    for label in labels:
        out[label].update(_combine_rounds(rounds[label]))
        out[label]["counters"] = counters
        out[label]["error_samples"] = [e for r in results for e in r["error_samples"]][:10]
    if floor_rounds:
        out["floor"] = _combine_floor(floor_rounds)
    return out


async def _floor_phase(run: Run, floor: Floor, events_per_s: float) -> Result:
    seconds = run.options.saturation_seconds
    run.progress.log(f"floor: C send() loop, {events_per_s:.0f} events/s for {seconds:g} s")
    run.activate("floor", "saturate")
    measured: FloorRun = await floor.run(seconds, events_per_s)
    return {"saturate": measured.figures()}


def _combine_floor(rounds: list[Result]) -> Result:
    """The floor's figures: medians over rounds, and every round (for per-round ratios)."""
    combined: Result = {}
    for key in rounds[0]["saturate"]:
        values = [float(r["saturate"][key]) for r in rounds]
        combined[key] = round(statistics.median(values), 3)
    return {"saturate": combined, "rounds": rounds}


def _phase_id(number: int, server: int, kind: int) -> int:
    return number * 100 + server * 10 + kind


async def _publish_phase(
    run: Run,
    label: str,
    publisher: Publisher,
    phase_id: int,
    rate: float | None,
    expected_before: int,
) -> tuple[PublishStats, tuple[dict[str, float], dict[str, float]]]:
    """One publishing phase and its drain; the meters over the window and over both."""
    options = run.options
    kind = "saturate" if rate is None else "steady"
    seconds = options.saturation_seconds if rate is None else options.duration
    what = "closed loop" if rate is None else f"{rate:.0f} publishes/s"
    run.progress.log(f"{label}: {kind}, {what} for {seconds:g} s")
    run.activate(label, kind)
    before = run.meter()
    run.stage = (f"{label}: {kind}", lambda: time.time() - before.wall, seconds)
    try:
        if rate is None:
            stats = await publisher.closed_loop(phase_id, seconds)
        else:
            stats = await publisher.fixed_rate(phase_id, rate, seconds)
    finally:
        run.stage = None
    window = run.interval(before, run.meter(), label)
    run.activate(label, "drain")
    await run.drain(expected_before + stats.expected_deliveries)
    return stats, (run.interval(before, run.meter(), label), window)


def _phase(
    stats: PublishStats,
    latency: Histogram,
    meter: dict[str, float],
    window: dict[str, float],
) -> Result:
    """Figures of one publishing phase.

    ``meter`` spans the phase and its drain (every delivery's CPU is in it);
    ``window`` only the publishing, to show how busy the server was meanwhile.
    """
    delivered = latency.count
    seconds = stats.duration
    cpu = meter["server_cpu_s"]
    return {
        "publishes": stats.accepted,
        "publish_failures": stats.failed,
        "publish_rate": round(stats.accepted / seconds, 1),
        "late_publishes": stats.late,
        "window_s": round(seconds, 3),
        "expected": stats.expected_deliveries,
        "delivered": delivered,
        "lost": stats.expected_deliveries - delivered,
        "delivered_per_s": round(delivered / seconds, 1),
        "delivered_per_cpu_s": round(delivered / cpu, 1) if cpu > 0 else math.nan,
        "latency": latency.summary_ms(),
        "window_server_cores": window["server_cores"],
        "window_generator_cores": window["generator_cores"],
        "window_generator_busiest_process": window["generator_busiest_process"],
        "window_generator_share": window["generator_share"],
        **meter,
    }


_SUMMED = ("publishes", "publish_failures", "late_publishes", "expected", "delivered", "lost")


def _combine_rounds(rounds: list[Result]) -> Result:
    """Headline figures: medians over rounds, sums of counts, latency over all rounds."""
    out: Result = {"rounds": []}
    for name in ("saturate", "steady"):
        phases = [r[name] for r in rounds]
        merged = Histogram()
        for phase in phases:
            merged.merge(phase.pop("_histogram"))
        combined: Result = {}
        for key, value in phases[0].items():
            values = [p[key] for p in phases]
            if key in _SUMMED:
                combined[key] = sum(values)
            elif key == "latency":
                combined[key] = merged.summary_ms()
            elif isinstance(value, int | float):
                numbers = [float(v) for v in values if not math.isnan(float(v))]
                combined[key] = round(statistics.median(numbers), 3) if numbers else math.nan
        combined["latency_cdf_ms"] = [(round(x / 1000, 4), round(y, 6)) for x, y in merged.cdf()]
        out[name] = combined
    out["rounds"] = rounds
    return out


def _fanout_verdicts(
    options: Options,
    servers: dict[str, Any],
    name: str,
    scenario: str,
    ratio_limit: float = 0.8,
    floor: Result | None = None,
) -> Result:
    ours = servers[name]
    out: Result = {}
    targets = []
    if "baseline" in servers:
        base = servers["baseline"]

        def rel(phase: str, key: str) -> float:
            """The median over rounds of ours / baseline within each round.

            Each round measures both servers minutes apart at most, so the
            per-round ratio cancels most of a shared machine's drift.
            """
            per_round = [
                ratio(o[phase][key], b[phase][key])
                for o, b in zip(ours["rounds"], base["rounds"], strict=False)
            ]
            numbers = [v for v in per_round if not math.isnan(v)]
            out.setdefault("ratio_rounds", {})[f"{key}_{phase}"] = [round(v, 3) for v in per_round]
            return round(statistics.median(numbers), 3) if numbers else math.nan

        def p99(figs: Result) -> float:
            value: float = figs["latency"]["p99_ms"]
            return value

        out["ratios"] = {
            "delivered_per_cpu_s_saturated": rel("saturate", "delivered_per_cpu_s"),
            "delivered_per_cpu_s_steady": rel("steady", "delivered_per_cpu_s"),
            "delivered_per_s_saturated": rel("saturate", "delivered_per_s"),
            "saturating_publish_rate": rel("saturate", "publish_rate"),
            "p99_latency_steady": ratio(p99(ours["steady"]), p99(base["steady"])),
            "rss_per_connection": ratio(
                ours["rss_per_connection_kib"], base["rss_per_connection_kib"]
            ),
        }
        spread = out["ratio_rounds"]["delivered_per_cpu_s_saturate"]
        targets.append(
            check(
                Target(
                    scenario,
                    "delivered messages per server CPU-second, ratio to the baseline",
                    "x",
                    ">=",
                    ratio_limit,
                ),
                out["ratios"]["delivered_per_cpu_s_saturated"],
                options.connections,
                note=f"saturated; median of the per-round ratios {spread}",
            )
        )
    steady = ours["steady"]
    if options.rate is not None:
        note = f"measured at --rate {options.rate:g}/s, not at half the saturating rate"
    else:
        note = f"at {steady['target_rate']:.0f} publishes/s"
    targets.append(
        check(
            Target(scenario, "p99 latency at half the saturating publish rate", "ms", "<=", 50.0),
            steady["latency"]["p99_ms"],
            options.connections,
            note=note,
        )
    )
    if floor is not None:
        targets.append(_floor_verdict(options, ours, floor, scenario, out))
    out["targets"] = targets
    return out


FLOOR_RATIO = 0.85
"""Issue 21: delivered frames per server CPU-second at least this share of the C floor's."""


def _floor_verdict(
    options: Options, ours: Result, floor: Result, scenario: str, out: Result
) -> dict[str, Any]:
    """Ours ÷ the C floor: the median of the per-round ratios (saturated)."""
    per_round = [
        ratio(o["saturate"]["delivered_per_cpu_s"], f["saturate"]["delivered_per_cpu_s"])
        for o, f in zip(ours["rounds"], floor["rounds"], strict=False)
    ]
    numbers = [v for v in per_round if not math.isnan(v)]
    value = round(statistics.median(numbers), 3) if numbers else math.nan
    spread = [round(v, 3) for v in per_round]
    out.setdefault("ratio_rounds", {})["floor_delivered_per_cpu_s_saturate"] = spread
    out.setdefault("ratios", {})["floor_delivered_per_cpu_s_saturated"] = value
    return check(
        Target(
            scenario,
            "delivered messages per server CPU-second, ratio to the C send() floor",
            "x",
            ">=",
            FLOOR_RATIO,
        ),
        value,
        options.connections,
        note=f"saturated; median of the per-round ratios {spread}",
    )


# --- presence -----------------------------------------------------------------


async def presence(run: Run) -> Result:
    """Observers watch join/leave churn: delta latency to every observer, and gaps."""
    proc = await run.start_server("ours")
    figures = await presence_one(run, "ours", [proc])
    await run.stop_servers("ours")
    return {
        "servers": {"ours": figures},
        "targets": _presence_verdicts(run.options, figures, "presence"),
    }


def _presence_verdicts(options: Options, figures: Result, scenario: str) -> list[dict[str, Any]]:
    observers = figures["observers"]
    debounce = options.debounce_ms
    return [
        check(
            Target(scenario, "seq gaps seen by observers", "", "<=", 0),
            figures["gaps"],
            observers,
        ),
        check(
            Target(
                scenario,
                "p99 time for a join to reach all observers",
                "ms",
                "<=",
                debounce + 100.0,
                ("observers", 5000),
            ),
            figures["joins_all_observers_ms"]["p99_ms"],
            observers,
            note=f"debounce {debounce} ms + 100 ms",
        ),
        check(
            Target(
                scenario,
                "p99 time for a leave to reach all observers",
                "ms",
                "<=",
                2 * debounce + 100.0,
                ("observers", 5000),
            ),
            figures["leaves_all_observers_ms"]["p99_ms"],
            observers,
            note=f"2 x debounce {debounce} ms + 100 ms: a leave waits a whole quiet window",
        ),
    ]


def _hold(options: Options) -> float:
    if options.hold is not None:
        return options.hold
    return max(2.0, 3 * options.debounce_ms / 1000)


async def presence_one(run: Run, label: str, procs: Sequence[Proc]) -> Result:
    options = run.options
    assert run.driver_worker is not None
    debounce = options.debounce_ms / 1000
    count = options.observers if options.observers is not None else options.connections
    full_every = max(1, count // options.full_observers) if options.full_observers > 0 else 0
    specs = [
        ClientSpec(
            user_id=f"obs{index}",
            track=True,
            full=bool(full_every) and index % full_every == 0,
        )
        for index in range(count)
    ]
    endpoints = [ws_endpoint(p) for p in procs]
    figures = await connect_measured(run, label, procs, specs)
    # the observers' own joins are committed after one debounce window
    run.activate(label, "settle")
    await run.wait_timed("settling", debounce + 1.0)
    subscribed = figures["subscribed"]
    hold = _hold(options)
    run.progress.log(
        f"{label}: churn, {options.churn:g} joins/s for {options.duration:g} s, "
        f"each user stays {hold:g} s, debounce {options.debounce_ms} ms"
    )
    run.activate(label, "churn")
    start_ns = time.time_ns() + 200_000_000
    before = run.meter()
    run.pool.send(
        run.driver_worker,
        {
            "op": "churn",
            "endpoints": endpoints,
            "rate": options.churn,
            "hold": hold,
            "duration": options.duration,
            "prefix": f"churn-{uuid.uuid4().hex[:6]}-",
            "start_ns": start_ns,
        },
    )
    total = options.duration + hold
    run.stage = (f"{label}: churn", lambda: time.time() - start_ns / 1e9, total)
    try:
        await run.pool.reply(run.driver_worker, "churn", limit=total + options.connect_timeout + 30)
    finally:
        run.stage = None
    run.activate(label, "drain")
    await run.wait_timed("draining", debounce + 1.0)
    meter = run.interval(before, run.meter(), label)
    await run.pool.broadcast({"op": "verify", "timeout": 5.0}, limit=30)
    results = await run.collect()
    counters = merge_counters(results[: len(run.observer_workers)])
    actions: dict[tuple[str, str], int] = {}
    for result in results:
        for user, kind, at in result["churn_actions"]:
            actions[(user, kind)] = at
    figures.update(presence_figures(actions, results, subscribed_observers=subscribed))
    figures.update(
        {
            "observers": count,
            "debounce_ms": options.debounce_ms,
            "churn_per_s": options.churn,
            "hold_s": hold,
            "gaps": counters.get("gaps", 0),
            "resyncs": counters.get("resyncs", 0),
            "stale_deltas": counters.get("stale_deltas", 0),
            "total_mismatches": counters.get("total_mismatches", 0),
            "full_observers_verified": counters.get("verified", 0),
            "state_mismatches": counters.get("state_mismatches", 0),
            "dropped": counters.get("dropped", 0),
            "churn_connect_failures": results[run.driver_worker]["counters"]["connect_failures"],
            "counters": counters,
            **meter,
        }
    )
    return figures


def presence_figures(
    actions: dict[tuple[str, str], int],
    results: Sequence[dict[str, Any]],
    subscribed_observers: int,
) -> Result:
    """Latency from each churn action to each observer's delta that shows it."""
    arrivals: dict[int, list[int]] = {}
    contents: dict[int, tuple[list[str], list[str]]] = {}
    inconsistent = 0
    for result in results:
        for seq, (joins, leaves, times) in result["seqs"].items():
            seq = int(seq)
            arrivals.setdefault(seq, []).extend(times)
            if seq in contents and contents[seq] != (joins, leaves):
                inconsistent += 1
            contents.setdefault(seq, (joins, leaves))
    pair_parts: list[np.ndarray[Any, np.dtype[np.int64]]] = []
    to_all: list[float] = []
    to_first: list[float] = []
    receipts: list[int] = []
    timeline: list[tuple[int, str, float, float]] = []
    seen: set[tuple[str, str]] = set()
    for seq, (joins, leaves) in contents.items():
        times = np.asarray(arrivals[seq], dtype=np.int64)
        for kind, users in (("join", joins), ("leave", leaves)):
            for user in users:
                at = actions.get((user, kind))
                if at is None:
                    continue
                seen.add((user, kind))
                latency = times - at
                pair_parts.append(latency)
                to_all.append(float(latency.max()) / 1e6)
                to_first.append(float(latency.min()) / 1e6)
                receipts.append(int(times.size))
                timeline.append((at, kind, to_all[-1], to_first[-1]))
    pairs = np.concatenate(pair_parts) / 1e6 if pair_parts else np.zeros(0)
    by_kind = {
        kind: np.asarray([to_all_ms for _, k, to_all_ms, _ in timeline if k == kind])
        for kind in ("join", "leave")
    }
    first_by_kind = {
        kind: np.asarray([first_ms for _, k, _, first_ms in timeline if k == kind])
        for kind in ("join", "leave")
    }
    return {
        "actions": len(actions),
        "actions_seen": len(seen),
        "actions_never_delivered": sum(1 for key in actions if key not in seen),
        "deltas_seen": len(contents),
        "inconsistent_deltas": inconsistent,
        "missed_receipts": int(sum(max(0, subscribed_observers - r) for r in receipts)),
        "pairs_ms": _summary(pairs),
        "all_observers_ms": _summary(np.asarray(to_all)),
        # a join is due within one window, a leave (held by the no-flap rule) within two
        "joins_all_observers_ms": _summary(by_kind["join"]),
        "leaves_all_observers_ms": _summary(by_kind["leave"]),
        # the commit's own timing, without the fan-out to every observer
        "joins_first_observer_ms": _summary(first_by_kind["join"]),
        "leaves_first_observer_ms": _summary(first_by_kind["leave"]),
        "first_observer_ms": _summary(np.asarray(to_first)),
        "pairs_cdf_ms": _sample_cdf(pairs),
        "all_observers_cdf_ms": _sample_cdf(np.asarray(to_all)),
        "per_action": _per_action(timeline),
    }


def _per_action(timeline: list[tuple[int, str, float, float]]) -> list[dict[str, Any]]:
    """Each churn action: seconds since the first, latency to the first and last observer."""
    if not timeline:
        return []
    timeline.sort()
    origin = timeline[0][0]
    return [
        {
            "t_s": round((at - origin) / 1e9, 3),
            "kind": kind,
            "all_ms": round(to_all, 2),
            "first_ms": round(to_first, 2),
        }
        for at, kind, to_all, to_first in timeline
    ]


def _summary(values: np.ndarray[Any, Any]) -> dict[str, float]:
    keys = ("mean_ms", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms")
    if values.size == 0:
        return {"count": 0, **dict.fromkeys(keys, math.nan)}
    p50, p90, p99, p999 = np.percentile(values, [50, 90, 99, 99.9], method="higher")
    numbers = (values.mean(), p50, p90, p99, p999, values.max())
    return {
        "count": int(values.size),
        **{k: round(float(v), 3) for k, v in zip(keys, numbers, strict=True)},
    }


def _sample_cdf(values: np.ndarray[Any, Any], points: int = 400) -> list[tuple[float, float]]:
    if values.size == 0:
        return []
    ordered = np.sort(values)
    index = np.unique(np.linspace(0, ordered.size - 1, min(points, ordered.size)).astype(int))
    return [(round(float(ordered[i]), 3), round((i + 1) / ordered.size, 6)) for i in index]


# --- storm --------------------------------------------------------------------


async def storm(run: Run) -> Result:
    """K browsers connect at the same instant: time until all hold a snapshot."""
    options = run.options
    specs = [ClientSpec(user_id=f"s{index}") for index in range(options.connections)]
    servers: dict[str, Any] = {}
    # ours twice: with the verified-token cache (the default) and without it;
    # each then takes a reconnect storm of the same clients with the same tokens.
    kinds = [*_servers(options), NO_TOKEN_CACHE]
    for kind in kinds:
        extra = ["--token-cache-size=0"] if kind == NO_TOKEN_CACHE else []
        proc = await run.start_server(kind, extra)
        servers[kind] = await _storm_one(run, kind, proc, specs)
        if kind != "baseline":
            servers[kind]["reconnect"] = await _reconnect_storm(run, kind, proc, len(specs))
        await run.stop_servers(kind)
    result: Result = {"servers": servers}
    result["ratios"] = {
        "reconnect_server_cpu_token_cache_on_over_off": ratio(
            servers["ours"]["reconnect"]["server_cpu_s"],
            servers[NO_TOKEN_CACHE]["reconnect"]["server_cpu_s"],
        )
    }
    if "baseline" in servers:
        result["ratios"]["time_to_all_subscribed"] = ratio(
            servers["ours"]["time_to_all_subscribed_s"],
            servers["baseline"]["time_to_all_subscribed_s"],
        )
    ours = servers["ours"]
    result["targets"] = [
        check(
            Target(
                "storm",
                "time until every client is subscribed with a snapshot",
                "s",
                "<=",
                10.0,
                ("clients", 10000),
            ),
            ours["time_to_all_subscribed_s"],
            options.connections,
        ),
        check(
            Target("storm", "failed connects", "", "<=", 0),
            ours["failed_connects"],
            options.connections,
        ),
    ]
    return result


async def _storm_one(run: Run, label: str, proc: Proc, specs: Sequence[ClientSpec]) -> Result:
    options = run.options
    await asyncio.sleep(0.5)
    rss_before = await run.rss_settled(label)
    run.activate(label, "connect")
    # time for the workers to mint every token before the common start
    go_ns = time.time_ns() + int(1.5e9) + len(specs) * 40_000
    await run.connect(
        specs, [ws_endpoint(proc)], label="storm", concurrency=None, at_ns=go_ns, wait_replies=False
    )
    await asyncio.sleep(max(0.0, (go_ns - time.time_ns()) / 1e9))
    before = run.meter()
    tcp_before = tcp_counters()
    run.progress.log(f"{label}: {len(specs)} clients connecting at once")
    done = await run.wait_for(
        f"{label}: storm",
        lambda: run.pool.total("subscribed"),
        len(specs),
        limit=options.storm_timeout,
    )
    meter = run.interval(before, run.meter(), label)
    tcp_after = tcp_counters()
    run.activate(label, "settle")
    rss_after = await run.rss_settled(label)
    results = await run.collect(run.observer_workers)
    await run.pool.broadcast({"op": "close_all"}, limit=30)
    with contextlib.suppress(WorkerError):
        await run.replies("connect", limit=30)
    counters = merge_counters(results)
    times = sorted((t - go_ns) / 1e9 for r in results for t in r["first_snapshot_ns"])
    subscribed = len(times)
    everyone = done and subscribed >= len(specs)
    step = max(1, len(times) // 400)
    return {
        "clients": len(specs),
        "subscribed": subscribed,
        "all_subscribed": everyone,
        "time_to_all_subscribed_s": round(times[-1], 3) if times and everyone else math.nan,
        "time_to_subscribed_s": seconds_summary(times),
        "failed_connects": counters.get("connect_failures", 0),
        "failed_connects_by_cause": failures_by_cause(counters),
        "dropped": counters.get("dropped", 0),
        "tcp_listen_queue": {
            name: tcp_after.get(name, 0) - tcp_before.get(name, 0) for name in tcp_after
        },
        "somaxconn": somaxconn(),
        "rss_before_bytes": rss_before,
        "rss_after_bytes": rss_after,
        "rss_per_connection_kib": _kib((rss_after - rss_before) / max(1, subscribed)),
        "subscribed_cdf_s": [
            (round(t, 4), round((i + 1) / len(specs), 6))
            for i, t in enumerate(times)
            if i % step == 0 or i == len(times) - 1
        ],
        "counters": counters,
        **meter,
    }


NO_TOKEN_CACHE = "ours_no_token_cache"


async def _reconnect_storm(run: Run, label: str, proc: Proc, count: int) -> Result:
    """Every client dropped and back at once with its token: server CPU until all
    are subscribed again (the token cache's saving shows here)."""
    await run.pool.broadcast({"op": "close_all"}, limit=30)  # the drop is not measured
    await asyncio.sleep(1.0)
    run.activate(label, "reconnect")
    already = run.pool.total("subscribed")
    hits_before = (await run_metrics(proc)).get("ap_token_cache_hits_total", 0.0)
    before = run.meter()
    for index in run.observer_workers:
        message = {
            "op": "reconnect",
            "at_ns": time.time_ns(),
            "timeout": run.options.connect_timeout,
        }
        run.pool.send(index, message)
    done = await run.wait_for(
        f"{label}: reconnect storm",
        lambda: run.pool.total("subscribed") - already,
        count,
        limit=run.options.storm_timeout,
    )
    meter = run.interval(before, run.meter(), label)
    hits = (await run_metrics(proc)).get("ap_token_cache_hits_total", 0.0) - hits_before
    with contextlib.suppress(WorkerError):
        await run.replies("reconnect", limit=30)
    await run.pool.broadcast({"op": "close_all"}, limit=30)
    return {"all_subscribed": done, "token_cache_hits": int(hits), **meter}


# --- cluster ------------------------------------------------------------------


async def cluster(run: Run) -> Result:
    """``fanout`` and ``presence`` over several nodes sharing Redis and DynamoDB (moto).

    The same fan-out, in the same run, over as many nodes on a six-instance
    Redis Cluster (3 primaries, 3 replicas; ``rcluster``), and then a primary
    of that cluster killed while events flow (``loadtest/scenarios/failover.py``).
    """
    options = run.options
    games = game_refs(options.games)
    specs, watchers = browser_specs(
        options.connections, games, options.games_per_conn, options.bots, run.rng
    )
    run.progress.log("starting redis-server and moto_server")
    redis_proc, redis_url = await start_redis()
    run.track(redis_proc)
    moto_proc, endpoint = await start_moto()
    run.track(moto_proc)
    table = f"loadtest-{uuid.uuid4().hex[:8]}"
    await create_table(endpoint, table)
    nodes: list[Proc] = []
    for index in range(options.nodes):
        run.progress.log(f"starting node-{index + 1}")
        node = await start_ours(
            f"node-{index + 1}",
            run.secrets,
            debounce_ms=options.debounce_ms,
            extra_args=options.server_args,
            cluster=(redis_url, endpoint, table),
        )
        nodes.append(run.track(node))
    run.add_server("cluster", nodes)
    run.add_server("redis", [redis_proc])
    run.progress.log("starting a Redis Cluster (6 redis-server instances)")
    rcluster = await asyncio.to_thread(start_redis_cluster)
    run.on_exit(rcluster.stop)
    if run.server_cpus:
        # On the servers' CPUs, as the single Redis is: both measured alike.
        for pid in rcluster.pids():
            os.sched_setaffinity(pid, run.server_cpus)
    rtable = f"loadtest-{uuid.uuid4().hex[:8]}"
    await create_table(endpoint, rtable)
    rnodes: list[Proc] = []
    for index in range(options.nodes):
        run.progress.log(f"starting rcluster-node-{index + 1}")
        node = await start_ours(
            f"rcluster-node-{index + 1}",
            run.secrets,
            debounce_ms=options.debounce_ms,
            extra_args=options.server_args,
            cluster=(rcluster.url, endpoint, rtable),
        )
        rnodes.append(run.track(node))
    run.add_server("rcluster", rnodes)
    targets: dict[str, list[Proc]] = {"cluster": nodes, "rcluster": rnodes}
    if options.baseline:
        targets = {"baseline": [await run.start_server("baseline")], **targets}
    redis_cpu = redis_proc.cpu()
    rcluster_cpu = rcluster.cpu_seconds()
    floor = c_floor(run, specs, games)
    try:
        fan = await fanout_compare(run, targets, specs, games, watchers, floor=floor)
    finally:
        floor.close()
    floor_figures = fan.pop("floor")
    fan["cluster"]["redis_cpu_s"] = round(redis_proc.cpu() - redis_cpu, 3)
    fan["rcluster"]["redis_cpu_s"] = round(rcluster.cpu_seconds() - rcluster_cpu, 3)
    await run.stop_servers("baseline")
    await run.pool.broadcast({"op": "close_all"}, limit=30)
    run.progress.log("rcluster: kill -9 of a primary while events flow")
    failover = await measure_failover(
        rcluster, rnodes, run.secrets.jwt, run.secrets.publish, after=options.failover_seconds
    )
    await run.stop_servers("rcluster")
    # the fanout clients' leaves are committed before the observers arrive
    await run.wait_timed("settling", options.debounce_ms / 1000 + 2.0)
    redis_cpu = redis_proc.cpu()
    pres = await presence_one(run, "cluster", nodes)
    pres["redis_cpu_s"] = round(redis_proc.cpu() - redis_cpu, 3)
    # the nodes reuse the memory the fanout clients left: not a per-connection figure
    pres.pop("rss_per_connection_kib", None)
    await run.stop_servers("cluster", "redis")
    servers: dict[str, Any] = {}
    if "baseline" in fan:
        servers["baseline"] = fan["baseline"]
    servers["cluster"] = {"nodes": options.nodes, "fanout": fan["cluster"], "presence": pres}
    servers["rcluster"] = {"nodes": options.nodes, "fanout": fan["rcluster"]}
    verdicts = _fanout_verdicts(options, fan, "cluster", "cluster fanout", floor=floor_figures)
    rverdicts = _rcluster_verdicts(options, fan, failover)
    return {
        "servers": servers,
        "floor": floor_figures,
        "watchers_per_game": mean_of(watchers),
        "ratios": {**verdicts.get("ratios", {}), **rverdicts["ratios"]},
        "failover": failover,
        "targets": verdicts["targets"]
        + _presence_verdicts(options, pres, "cluster presence")
        + rverdicts["targets"],
    }


async def bridge(run: Run) -> Result:
    """Today's broadcast queue (moto SQS) through two bridging nodes to sockets."""
    from loadtest.scenarios.bridge import bridge as run_bridge

    return await run_bridge(run)


def _rcluster_verdicts(options: Options, fan: dict[str, Any], failover: Result) -> Result:
    """Redis Cluster against one Redis, measured in the same run, round by round."""
    one, sharded = fan["cluster"], fan["rcluster"]
    per_round = [
        ratio(r["saturate"]["delivered_per_cpu_s"], o["saturate"]["delivered_per_cpu_s"])
        for r, o in zip(sharded["rounds"], one["rounds"], strict=False)
    ]
    numbers = [v for v in per_round if not math.isnan(v)]
    cpu_ratio = round(statistics.median(numbers), 3) if numbers else math.nan
    ratios = {
        "rcluster_delivered_per_cpu_s_saturated": cpu_ratio,
        "rcluster_p99_latency_steady": ratio(
            sharded["steady"]["latency"]["p99_ms"], one["steady"]["latency"]["p99_ms"]
        ),
    }
    scenario = "cluster on Redis Cluster"
    targets = [
        check(
            Target(
                scenario,
                "delivered per server CPU-second, Redis Cluster / one Redis",
                "x",
                ">=",
                0.9,
            ),
            cpu_ratio,
            options.connections,
            note=f"saturated; median of the per-round ratios {[round(v, 3) for v in per_round]}",
        ),
        check(
            Target(scenario, "p99 latency at half the saturating rate", "ms", "<=", 50.0),
            sharded["steady"]["latency"]["p99_ms"],
            options.connections,
        ),
        check(
            Target(scenario, "kill -9 of a primary to delivery resumed", "s", "<=", 5.0),
            failover["resumed_after_s"],
            options.connections,
            note=f"slowest of {failover['probes']} probes",
        ),
        check(
            Target(scenario, "events lost across the failover", "", "<=", 0),
            failover["lost"],
            options.connections,
            note=f"of {failover['accepted']} accepted, to {failover['probes']} probes",
        ),
    ]
    return {"ratios": ratios, "targets": targets}


async def bots(run: Run) -> Result:
    """``bots``: turns published to bots; with ``--bot-queue``, fed through the bot queue."""
    return await (bots_queue(run) if run.options.bot_queue else bots_published(run))


SCENARIOS = {
    "bots": bots,
    "abuse": abuse,
    "churn": churn,
    "idle": idle,
    "fanout": fanout,
    "presence": presence,
    "storm": storm,
    "cluster": cluster,
    "baseline": baseline,
    "bridge": bridge,
    "streammem": streammem,
}
