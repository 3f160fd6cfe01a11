"""Command line: ``python -m loadtest SCENARIO [options]``."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.harness.procstat import machine, raise_fd_limit
from loadtest.harness.progress import Progress
from loadtest.harness.runner import Options, Run
from loadtest.report.targets import format_value
from loadtest.scenarios.core import SCENARIOS as BASE_SCENARIOS
from loadtest.scenarios.streams import STREAM_SCENARIOS

SCENARIOS = {**BASE_SCENARIOS, **STREAM_SCENARIOS}

DEFAULTS: dict[str, dict[str, Any]] = {
    "idle": {
        "connections": 10000,
        "games": 1000,
        "games_per_conn": 5,
        "bots": 0.0,
        "duration": 2.0,
    },
    "fanout": {"connections": 2000, "games": 200, "games_per_conn": 10, "bots": 0.1},
    "baseline": {"connections": 2000, "games": 200, "games_per_conn": 10, "bots": 0.1},
    "presence": {"connections": 5000, "duration": 15.0},
    "storm": {"connections": 10000},
    "cluster": {"connections": 2000, "games": 200, "games_per_conn": 10, "bots": 0.1},
    "bridge": {"connections": 2000, "duration": 20.0, "rate": 2000.0},
    "bots": {"connections": 500, "games_per_conn": 10, "rate": 200.0, "duration": 10.0},
    "abuse": {
        "connections": 1000,
        "games": 200,
        "games_per_conn": 10,
        "bots": 0.1,
        "duration": 4.0,
        "rate": 100.0,
    },
    "churn": {"connections": 500, "rounds": 20},
    # one watcher per game: the figure is the publish path, not the fan-out
    "publish": {
        "connections": 1000,
        "games": 1000,
        "games_per_conn": 1,
        "bots": 0.0,
        "duration": 5.0,
        "publishers": 32,
    },
    "recovery": {"connections": 5000, "games": 1000, "games_per_conn": 5, "bots": 0.0},
    "streammem": {"connections": 10000},
}

HELP = {
    "idle": "N subscribed connections: server RSS per connection",
    "fanout": "N connections watching M games under publishes: throughput, CPU, latency",
    "presence": "join/leave churn: delta latency to every observer, seq gaps",
    "storm": "K clients connect at once: time until all hold a snapshot, failed connects",
    "cluster": (
        "fanout and presence over several nodes, Redis and DynamoDB (moto); the same fanout "
        "over a 6-instance Redis Cluster, and a primary's kill -9"
    ),
    "baseline": "the fanout measurement of the minimal websockets.broadcast server alone",
    "bridge": "SQS queue (moto) -> two bridging nodes -> watchers, then one node killed",
    "bots": "bots on one node get yourTurn events published via another; that node restarts",
    "abuse": "attacks on one node while N normal clients receive events: their p99, RSS, "
    "losses, and every attacker's close code",
    "churn": "rounds of N connect/subscribe/close: server memory left behind",
    "publish": "events/s into the streams from one node, and latency at half that rate",
    "recovery": "K clients reconnect at once with since after missing events: time, lost, dups",
    "streammem": "Redis memory per stream (N streams through the Lua script), idle and full",
}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("common")
    group.add_argument("--connections", "-n", type=int, help="clients (observers, storm clients)")
    group.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 2,
        help="generator processes (default: one per core)",
    )
    group.add_argument("--duration", type=float, help="seconds of the measured phase")
    group.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    group.add_argument("--report", type=Path, metavar="DIR", help="write report.md and PNG plots")
    group.add_argument("--no-progress", action="store_true", help="no live progress bar")
    group.add_argument(
        "--no-baseline", action="store_true", help="skip the baseline server in this run"
    )
    group.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for our server (repeat; e.g. --server-arg=--listen-backlog=4096)",
    )
    group.add_argument(
        "--server-cpus",
        default="0" if (os.cpu_count() or 1) >= 2 else "",
        metavar="LIST",
        help="CPUs for the servers under test, e.g. 0 or 0,1; the generator gets the rest "
        "('' for no pinning; default: 0 when there are 2 or more CPUs)",
    )
    group.add_argument("--ramp", type=int, default=100, help="connects in flight per worker")
    group.add_argument("--connect-timeout", type=float, default=15.0)
    group.add_argument("--debounce-ms", type=int, default=1000, help="our server's debounce")
    group.add_argument("--timeout", type=float, default=1800.0, help="hard limit for the run (s)")
    group.add_argument("--seed", type=int, default=1)

    fan = argparse.ArgumentParser(add_help=False)
    group = fan.add_argument_group("fanout")
    group.add_argument("--games", type=int, help="games M")
    group.add_argument("--games-per-conn", type=int, help="games each client watches")
    group.add_argument("--bots", type=float, help="share of clients that are bots (0..1)")
    group.add_argument(
        "--rate", type=float, help="publishes/s of the steady phase (default: half saturating)"
    )
    group.add_argument("--saturation-seconds", type=float, default=5.0)
    group.add_argument(
        "--warmup-seconds", type=float, default=2.0, help="unmeasured publishing per server"
    )
    group.add_argument(
        "--rounds", type=int, help="rounds (fanout: interleaved, medians reported; default 3)"
    )
    group.add_argument("--publishers", type=int, help="publish connections (default 16)")

    pres = argparse.ArgumentParser(add_help=False)
    group = pres.add_argument_group("presence")
    group.add_argument("--observers", type=int, help="observers (presence; default --connections)")
    group.add_argument("--churn", type=float, default=20.0, help="new users joining per second")
    group.add_argument("--hold", type=float, help="seconds each churn user stays")
    group.add_argument("--full-observers", type=int, default=2, help="observers checking state")

    streams = argparse.ArgumentParser(add_help=False)
    group = streams.add_argument_group("streams")
    group.add_argument(
        "--bus",
        choices=("embedded", "redis", "both"),
        default="both",
        help="run a node on the in-process bus, on the Redis bus, or both in turn (default)",
    )

    parser = argparse.ArgumentParser(
        prog="python -m loadtest",
        description="Load tests for the Abstract Play real-time server.",
        epilog="Also: chaos (minutes of random faults over 3 nodes; "
        "python -m loadtest chaos --help).",
    )
    commands = parser.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name in SCENARIOS:
        parents = [common]
        if name in (
            "fanout",
            "baseline",
            "cluster",
            "idle",
            "publish",
            "recovery",
            "bots",
            "abuse",
            "churn",
        ):
            parents.append(fan)
        if name in STREAM_SCENARIOS:
            parents.append(streams)
        if name in ("presence", "cluster"):
            parents.append(pres)
        sub = commands.add_parser(name, parents=parents, help=HELP[name], description=HELP[name])
        if name == "bridge":
            sub.add_argument("--rate", type=float, help="messages/s into the queue (2000)")
        if name == "storm":
            sub.add_argument("--storm-timeout", type=float, default=60.0)
        if name == "recovery":
            sub.add_argument(
                "--storm-timeout",
                type=float,
                default=180.0,
                help="seconds to wait for every client's recovered answers",
            )
        if name == "recovery":
            sub.add_argument(
                "--away-events",
                type=int,
                default=10,
                help="events published to each game while the clients are away",
            )
        if name == "cluster":
            sub.add_argument("--nodes", type=int, default=2)
            sub.add_argument(
                "--failover-seconds",
                type=float,
                help="events keep flowing this long after a Redis Cluster primary is killed",
            )
        if name == "abuse":
            sub.add_argument(
                "--attackers", type=float, default=1.0, help="scale of every attack's count"
            )
            sub.add_argument(
                "--pad", type=int, default=2000, help="payload bytes added to each steady event"
            )
            sub.add_argument(
                "--attack", action="append", default=[], help="run only this attack (repeat)"
            )
    return parser


def options_from(args: argparse.Namespace) -> Options:
    defaults = DEFAULTS[args.scenario]
    options = Options(scenario=args.scenario)

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        if value is None:
            value = defaults.get(name, getattr(options, name))
        return value

    for name in (
        "connections",
        "duration",
        "games",
        "games_per_conn",
        "bots",
        "rate",
        "saturation_seconds",
        "rounds",
        "warmup_seconds",
        "publishers",
        "churn",
        "hold",
        "full_observers",
        "storm_timeout",
        "nodes",
        "failover_seconds",
        "observers",
        "away_events",
    ):
        setattr(options, name, pick(name))
    options.workers = max(1, args.workers)
    options.ramp = args.ramp
    options.connect_timeout = args.connect_timeout
    options.debounce_ms = args.debounce_ms
    options.timeout = args.timeout
    options.seed = args.seed
    options.baseline = not args.no_baseline
    options.server_args = list(args.server_arg)
    options.server_cpus = [int(c) for c in args.server_cpus.split(",") if c.strip()]
    options.progress = not args.no_progress
    if args.scenario == "abuse":
        options.attackers = args.attackers
        options.abuse_pad = args.pad
        options.attacks = list(args.attack)
    bus = getattr(args, "bus", "both")
    options.buses = ("embedded", "redis") if bus == "both" else (bus,)
    if args.scenario == "cluster" and options.observers is None:
        options.observers = options.connections
    return options


async def execute(options: Options, progress: Progress) -> dict[str, Any]:
    extra = 1 if options.scenario in ("presence", "cluster") else 0
    async with Run(options, progress, extra_workers=extra) as run:
        scenario = SCENARIOS[options.scenario]
        figures = await asyncio.wait_for(scenario(run), options.timeout)
        generator = run.generator_total()
        series = run.series
        pinning = {
            "server_cpus": sorted(run.server_cpus),
            "generator_cpus": sorted(run.generator_cpus),
        }
    return {"figures": figures, "generator": generator, "pinning": pinning, "series": series}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["chaos"]:
        # Its own processes and clients, not the worker pool: loadtest/scenarios/chaos.py.
        from loadtest.scenarios import chaos

        return chaos.main(given[1:])
    args = build_parser().parse_args(argv)
    options = options_from(args)
    fd_limit = raise_fd_limit()
    progress = Progress(options.progress)
    # Ctrl-C and SIGTERM (e.g. from `timeout`) both stop every server and worker;
    # SIGINT is set explicitly because a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    started = datetime.datetime.now(datetime.UTC)
    progress.log(
        f"loadtest {options.scenario}: {options.connections} connections, "
        f"{options.workers} generator processes, fd limit {fd_limit}"
    )
    try:
        import uvloop

        outcome = uvloop.run(execute(options, progress))
    except KeyboardInterrupt:
        progress.clear()
        print("loadtest: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        progress.clear()
        traceback.print_exc()
        print(f"loadtest: {options.scenario} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    progress.clear()
    result = {
        "scenario": options.scenario,
        "date": started.isoformat(timespec="seconds"),
        "command": ["python", "-m", "loadtest", *(argv if argv is not None else sys.argv[1:])],
        "machine": machine(),
        "options": {k: v for k, v in vars(options).items()},
        **outcome,
    }
    print("\n".join(summary_lines(result)))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_clean(result), indent=1) + "\n")
        print(f"figures: {args.json}")
    if args.report is not None:
        from loadtest.report.plots import write_report

        path = write_report(result, args.report)
        print(f"report: {path}")
    return 0


def _clean(value: Any) -> Any:
    """JSON has no NaN: write null."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def figure_rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(server, figure, value) rows of the headline figures of a run."""
    rows: list[tuple[str, str, str]] = []
    servers: dict[str, Any] = result["figures"]["servers"]
    for name, figs in servers.items():
        if name == "bridge":
            rows += _bridge_rows(figs)
        elif name == "cluster":
            for part in ("fanout", "presence"):
                rows += _server_rows(f"cluster ({figs['nodes']} nodes) {part}", figs[part])
        elif name == "rcluster":
            rows += _server_rows(f"Redis Cluster ({figs['nodes']} nodes) fanout", figs["fanout"])
        else:
            rows += _server_rows(name, figs)
    return rows


def _server_rows(name: str, figs: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []

    def add(label: str, value: Any, unit: str = "") -> None:
        rows.append((name, label, f"{_fmt(value)} {unit}".strip()))

    if "bytes_per_stream_full_history" in figs:
        add("streams", figs["streams"])
        add("Redis bytes per stream, 1 event", figs["bytes_per_stream_one_event"], "B")
        add(
            f"Redis bytes per stream, {figs['history_size']} events (cap)",
            figs["bytes_per_stream_full_history"],
            "B",
        )
        add("Redis bytes per stream, meta only", figs["bytes_per_stream_meta_only"], "B")
        add("growth past the cap, per stream", figs["growth_past_cap_bytes_per_stream"], "B")
    if "rss_per_connection_kib" in figs:
        add("RSS per connection", figs["rss_per_connection_kib"], "KiB")
    if "redis_cpu_s" in figs:
        add("Redis CPU over the scenario", figs["redis_cpu_s"], "s")
    if "redis_memory" in figs:
        memory = figs["redis_memory"]
        add(
            "Redis memory per active stream",
            f"{_fmt(memory['per_stream_bytes'])} B ({memory['streams']} streams)",
        )
    if "saturate" in figs:
        for phase in ("saturate", "steady"):
            p = figs[phase]
            tag = "saturated" if phase == "saturate" else "steady"
            add(f"{tag}: publish rate", p["publish_rate"], "/s")
            if "publishes_per_cpu_s" in p:
                add(f"{tag}: publishes per server CPU-s", p["publishes_per_cpu_s"], "/s")
            add(f"{tag}: delivered", p["delivered_per_s"], "msg/s")
            per_round = ", ".join(
                _fmt(r[phase]["delivered_per_cpu_s"]) for r in figs.get("rounds", [])
            )
            add(
                f"{tag}: delivered per server CPU-s",
                f"{_fmt(p['delivered_per_cpu_s'])} msg (rounds: {per_round})",
            )
            add(f"{tag}: server CPU while publishing", p["window_server_cores"], "cores")
            lat = p["latency"]
            rounds_p99 = ", ".join(
                _fmt(r[phase]["latency"]["p99_ms"]) for r in figs.get("rounds", [])
            )
            add(
                f"{tag}: latency p50/p99/p999",
                f"{_fmt(lat['p50_ms'])} / {_fmt(lat['p99_ms'])} / {_fmt(lat['p999_ms'])} ms"
                f" (p99 by round: {rounds_p99})",
            )
            add(f"{tag}: lost (expected - delivered)", p["lost"])
            add(
                f"{tag}: generator CPU (busiest process)",
                f"{_fmt(p['window_generator_cores'])} "
                f"({_fmt(p['window_generator_busiest_process'])})",
                "cores",
            )
    if "time_to_all_subscribed_s" in figs:
        add("time until all subscribed", figs["time_to_all_subscribed_s"], "s")
        t = figs["time_to_subscribed_s"]
        add("per-client time to snapshot p50/p99", f"{_fmt(t['p50_s'])} / {_fmt(t['p99_s'])}", "s")
        add("subscribed", f"{figs['subscribed']} / {figs['clients']}")
        add("failed connects", figs["failed_connects"])
        queue = figs.get("tcp_listen_queue") or {}
        if queue:
            add(
                "listen queue overflows (system-wide)",
                f"{queue.get('ListenOverflows', 0)} (somaxconn {figs.get('somaxconn')})",
            )
        add("generator CPU", figs["generator_cores"], "cores")
    if "missed" in figs and "restart" in figs:
        steady, restart = figs["steady"], figs["restart"]
        lat = steady["latency"]
        add("bots x games per bot", f"{figs['bots']} x {figs['games_per_bot']}")
        add("yourTurn rate (steady)", figs["steady_publish_rate"], "/s")
        add(
            "steady: publish -> bot p50/p99/p999",
            f"{_fmt(lat['p50_ms'])} / {_fmt(lat['p99_ms'])} / {_fmt(lat['p999_ms'])}",
            "ms",
        )
        add("steady: server CPU (both nodes)", steady["server_cores"], "cores")
        add(
            "restart: stopped / ready again / all bots resubscribed",
            f"{_fmt(restart['stop_s'])} / {_fmt(restart['back_ready_s'])} / "
            f"{_fmt(restart['all_resubscribed_s'])}",
            "s",
        )
        add("restart: bots resubscribed", f"{restart['resubscribed']} / {figs['bots']}")
        add(
            "restart: recovered true / false",
            f"{restart['recovered_true']} / {restart['recovered_false']}",
        )
        rep = restart["latency_incl_replay"]
        add(
            "during and after the restart: p50/p99/max (incl. replays)",
            f"{_fmt(rep['p50_ms'])} / {_fmt(rep['p99_ms'])} / {_fmt(rep['max_ms'])}",
            "ms",
        )
        add("turns accepted / publish failures", f"{figs['accepted']} / {figs['publish_failures']}")
        add("turns missed / duplicates", f"{figs['missed']} / {figs['duplicates']}")
        add(
            "pendingTurns frames / wrong",
            f"{figs['pending_turns_frames']} / {figs['pending_turns_wrong']}",
        )
    if "stream_checks" in figs and "saturate" in figs:
        c = figs["stream_checks"]
        add(
            "stream checks: duplicates / holes (events) / epoch changes / unpositioned",
            f"{c['duplicates']} / {c['holes']} ({c['lost']}) / {c['epoch_changes']}"
            f" / {c['unpositioned']}",
        )
    if "time_to_all_recovered_s" in figs:
        t = figs["time_to_recovered_s"]
        add("time until all recovered", figs["time_to_all_recovered_s"], "s")
        add(
            "per-client time to recovered p50/p90/p99/max",
            f"{_fmt(t['p50_s'])} / {_fmt(t['p90_s'])} / {_fmt(t['p99_s'])} / {_fmt(t['max_s'])}",
            "s",
        )
        snap = figs["time_to_snapshot_s"]
        add(
            "per-client time to snapshot p50/p99",
            f"{_fmt(snap['p50_s'])} / {_fmt(snap['p99_s'])}",
            "s",
        )
        add("clients recovered", f"{figs['recovered_clients']} / {figs['clients']}")
        add("missed events / replayed", f"{figs['missed_events']} / {figs['replayed_events']}")
        add("lost (in holes + behind the top at the end)", figs["lost"])
        add("duplicated", figs["duplicated"])
        add(
            "recovered true / false / short",
            f"{figs['recovered_true']} / {figs['recovered_false']} / {figs['recovered_short']}",
        )
        add("failed connects", figs["failed_connects"])
        add(
            "server CPU during the storm",
            f"{_fmt(figs['server_cpu_s'])} CPU-s ({_fmt(figs['server_cores'])} cores)",
        )
        add("server waiting for a CPU held by others", figs["server_cpu_wait_s"], "s")
        add("generator CPU", figs["generator_cores"], "cores")
    if "all_observers_ms" in figs:
        a, p = figs["all_observers_ms"], figs["pairs_ms"]
        add("observers subscribed", figs["subscribed"])
        add("churn actions seen / made", f"{figs['actions_seen']} / {figs['actions']}")
        add(
            "change -> all observers p50/p99/max",
            f"{_fmt(a['p50_ms'])} / {_fmt(a['p99_ms'])} / {_fmt(a['max_ms'])}",
            "ms",
        )
        add(
            "change -> each observer p50/p99/p999",
            f"{_fmt(p['p50_ms'])} / {_fmt(p['p99_ms'])} / {_fmt(p['p999_ms'])}",
            "ms",
        )
        add("seq gaps", figs["gaps"])
        add("missed receipts", figs["missed_receipts"])
        add(
            "full observers verified / mismatched",
            f"{figs['full_observers_verified']} / {figs['state_mismatches']}",
        )
        add("server CPU", figs["server_cores"], "cores")
        add("generator CPU", figs["generator_cores"], "cores")
    return rows


def _bridge_rows(figs: dict[str, Any]) -> list[tuple[str, str, str]]:
    alone = figs["moto_alone"]
    rows: list[tuple[str, str, str]] = [
        (
            "moto alone",
            "sent / asked rate (no consumer)",
            f"{_fmt(alone['send_rate'])} / {_fmt(alone['rate_asked'])} msg/s",
        ),
        (
            "moto alone",
            "SendMessageBatch p50/p99",
            f"{_fmt(alone['send_call_ms']['p50'])} / {_fmt(alone['send_call_ms']['p99'])} ms",
        ),
    ]
    idle = figs["idle"]
    rows.append(
        (
            "bridge idle",
            "CPU cores, nothing sent (settled after)",
            ", ".join(f"{k} {_fmt(v)}" for k, v in idle["cpu_cores"].items())
            + f" ({_fmt(idle['settled_after_s'])} s)",
        )
    )
    for phase in ("steady", "backlog", "kill"):
        p = figs[phase]
        name = f"bridge {phase}"
        lat = p["latency"]
        rows += [
            (name, "sent / asked rate", f"{_fmt(p['send_rate'])} / {_fmt(p['rate_asked'])} msg/s"),
            (name, "messages sent (failed)", f"{_fmt(p['sent'])} ({_fmt(p['send_failed'])})"),
            (
                name,
                "SendMessageBatch p50/p99",
                f"{_fmt(p['send_call_ms']['p50'])} / {_fmt(p['send_call_ms']['p99'])} ms",
            ),
            (
                name,
                "queue -> socket p50/p90/p99/max",
                f"{_fmt(lat['p50_ms'])} / {_fmt(lat['p90_ms'])} / {_fmt(lat['p99_ms'])}"
                f" / {_fmt(lat['max_ms'])} ms",
            ),
            (
                name,
                "queue accepted -> socket p50/p99",
                f"{_fmt(p['accepted_to_socket']['p50_ms'])}"
                f" / {_fmt(p['accepted_to_socket']['p99_ms'])} ms",
            ),
            (
                name,
                "deliveries (watchers counted)",
                f"{_fmt(p['deliveries'])} ({p['watchers_counted']})",
            ),
            (name, "lost / duplicated", f"{p['lost']} / {p['dup']}"),
            (
                name,
                "not yet delivered (still queued)",
                f"{p['undelivered']} ({p['queue_left']} in the queue at the end)",
            ),
            (
                name,
                "CPU per message: nodes / moto",
                f"{_fmt(p['node_cpu_ms_per_message'])} / {_fmt(p['moto_cpu_ms_per_message'])} ms",
            ),
            (
                name,
                "nodes' CPU above idle, per message",
                f"{_fmt(p['node_marginal_cpu_ms_per_message'])} ms"
                f" ({_fmt(p['messages_per_node_cpu_second'])} msg per node CPU-second)",
            ),
            (
                name,
                "sender CPU per message (processes)",
                f"{_fmt(p['sender_cpu_ms_per_message'])} ms ({p['senders']})",
            ),
            (
                name,
                "queue depth mean / max (visible, in flight, delayed)",
                f"{_fmt(p['queue_depth']['mean'])} / {_fmt(p['queue_depth']['max'])}",
            ),
            (
                name,
                "CPU cores (moto, redis, nodes)",
                ", ".join(f"{k} {_fmt(v)}" for k, v in p["cpu_cores"].items()),
            ),
        ]
        if p.get("killed"):
            rows.append((name, "killed", str(p["killed"])))
    return rows


GENERATOR_LIMIT = 0.9


def _generator_limited(value: Any, path: str = "") -> list[str]:
    """Where in the figures the generator was near its CPU limit."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, inner in value.items():
            if key in ("generator_share", "window_generator_share") and isinstance(
                inner, int | float
            ):
                if inner >= GENERATOR_LIMIT:
                    found.append(path.strip("/") or "run")
            elif key != "rounds":
                found += _generator_limited(inner, f"{path}/{key}")
    return found


def summary_lines(result: dict[str, Any]) -> list[str]:
    figures = result["figures"]
    lines = [f"== loadtest {result['scenario']} ({result['date']}) =="]
    rows = figure_rows(result)
    width = max((len(f"{s}  {f}") for s, f, _ in rows), default=20)
    for server, figure, value in rows:
        lines.append(f"  {f'{server}  {figure}':<{width}}  {value}")
    ratios: dict[str, float] = figures.get("ratios", {})
    if ratios:
        lines.append("ratios to the baseline (ours / baseline, same run):")
        for name, rel in ratios.items():
            lines.append(f"  {name:<34} {_fmt(rel)}")
    gen = result["generator"]
    lines.append(
        f"generator: {gen['generator_cpu_s']:.1f} CPU-s over {gen['wall_s']:.1f} s "
        f"({gen['generator_cores']:.2f} cores; "
        f"busiest process {gen['generator_busiest_process']:.2f})"
    )
    busy = sorted(set(_generator_limited(figures["servers"])))
    if gen.get("generator_share", 0) >= GENERATOR_LIMIT:
        busy.append("the whole run")
    if busy:
        lines.append(
            "note: the generator used >= 90% of its CPUs during: "
            + ", ".join(busy)
            + "; latency there includes the generator's own queueing"
        )
    targets = figures.get("targets", [])
    if targets:
        lines.append("targets:")
        for t in targets:
            shown = format_value(t["value"], t["unit"])
            limit = format_value(t["limit"], t["unit"])
            note = f"  ({t['note']})" if t["note"] else ""
            lines.append(
                f"  [{t['verdict'].upper():5}] {t['scenario']}: {t['figure']} "
                f"{t['op']} {limit}: {shown}{note}"
            )
    return lines
