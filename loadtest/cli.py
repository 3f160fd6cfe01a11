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
from loadtest.report.summary import summary_lines
from loadtest.scenarios.chat import chat
from loadtest.scenarios.connect_storm import connect_storm
from loadtest.scenarios.core import SCENARIOS as BASE_SCENARIOS
from loadtest.scenarios.sdk import fleet_count, sdk
from loadtest.scenarios.streams import STREAM_SCENARIOS

SCENARIOS = {
    **BASE_SCENARIOS,
    **STREAM_SCENARIOS,
    "sdk": sdk,
    "chat": chat,
    "connect": connect_storm,
}

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
    "sdk": {"connections": 2000, "games": 200, "games_per_conn": 3, "duration": 10.0, "rate": 40.0},
    "chat": {"connections": 4, "duration": 20.0, "rate": 20.0},
    "connect": {"connections": 2000, "games": 200, "games_per_conn": 10, "rounds": 3},
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
    "sdk": "N Python-SDK clients on 3 nodes through a kill -9 and a rolling restart: events "
    "missed/duplicated as the handlers saw them, close -> recovered, accepts per second",
    "chat": "N authors on one game from 2 nodes, comments at --rate/s: post -> chatAck latency",
    "connect": "fan-out during and right after N connects: cluster node / embedded node, "
    "delivered per server CPU-s",
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
        "python -m loadtest chaos --help) and table (the README's results table from "
        "loadtest/results/*.json; python -m loadtest table --help).",
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
            "sdk",
            "chat",
            "connect",
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
        if name == "bots":
            sub.add_argument(
                "--bot-queue",
                action="store_true",
                help="feed the turns through the bot outbound queue on moto: a bot node "
                "killed, half of the bots away (forwarded); --rate is messages/s (100)",
            )
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
        if name == "sdk":
            sub.add_argument(
                "--accept-rate",
                type=float,
                default=500.0,
                help="each node's --accept-rate, and the limit of its accepts in any second",
            )
            sub.add_argument(
                "--drain-seconds", type=float, default=10.0, help="each node's --drain-seconds"
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
    if args.scenario == "sdk":
        options.accept_rate = args.accept_rate
        options.drain_seconds = args.drain_seconds
    if args.scenario == "bots":
        options.bot_queue = args.bot_queue
        if args.bot_queue and args.rate is None:
            options.rate = 100.0
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
    if given[:1] == ["table"]:
        # Rewrites loadtest/README.md's results table from loadtest/results/*.json.
        from loadtest.report import table

        return table.main(given[1:])
    args = build_parser().parse_args(argv)
    options = options_from(args)
    fd_limit = raise_fd_limit()
    progress = Progress(options.progress)
    # Ctrl-C and SIGTERM (e.g. from `timeout`) both stop every server and worker;
    # SIGINT is set explicitly because a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    workers = options.workers
    if options.scenario == "sdk":
        workers = fleet_count(options.workers, options.connections)
    progress.log(
        f"loadtest {options.scenario}: {options.connections} connections, "
        f"{workers} generator processes, fd limit {fd_limit}"
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
        # the machine is shared: how busy it was says how far wall-clock figures can be trusted
        "load_average": {"start": list(load_before), "end": list(os.getloadavg())},
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
