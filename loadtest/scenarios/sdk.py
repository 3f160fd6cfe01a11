"""The ``sdk`` scenario (issue 19): Python-SDK clients across three nodes, through a
kill -9 and a rolling restart of every node, counting what the handlers see.

- Three cluster nodes on one Redis and one DynamoDB table (moto), each with
  ``--accept-rate`` and ``--drain-seconds``. ``--connections`` clients
  (``apclient.RealtimeClient``) run in fleet processes (``--workers``, and at
  least one per ``CLIENTS_PER_FLEET`` clients); each user
  watches ``--games-per-conn`` of ``--games`` games and has its own user stream,
  and knows all three nodes, its own first.
- Once every client is connected, a publisher posts events at ``--rate`` per
  second through the live nodes: ``game`` events to random games and, one in
  ten, a ``notification`` to a random user, each named by an
  ``Idempotency-Key`` and tried on the next node after a failure. It keeps the
  position of each one accepted (202), and counts the retries.
- After ``--duration`` seconds, a rolling restart: each node in turn gets SIGTERM
  (it drains over ``--drain-seconds`` with 1012) and starts again on its ports,
  the next only once every client is connected again. Then ``kill -9`` of the
  node holding the most clients, started again on its ports 2 s later.
- Then publishing stops, and each client compares what its handlers saw with
  what was accepted on its streams: missed, duplicated, unexpected.

Figures: events missed and duplicated as seen by the handlers; the time from
each close to the next acknowledged subscribe (recovery answered), p50/p99/max;
each node's accepts in any one-second window, from its
``ap_accepted_upgrades_total`` sampled every 0.1 s, against ``--accept-rate``;
and the machine's load average, since the machine is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from loadtest.clients.sdk_fleet import ClientPlan, FleetSpec, fleet_main
from loadtest.harness.procstat import cpu_seconds, run_delay_seconds
from loadtest.harness.runner import Run, game_refs
from loadtest.harness.servers import (
    HOST,
    Proc,
    StartError,
    create_table,
    start_moto,
    start_ours,
    start_redis,
)
from loadtest.report.targets import Target, check

Result = dict[str, Any]

TARGETS = {
    "missed": Target("sdk", "events missed, as the handlers saw them", "", "<=", 0),
    "duplicated": Target("sdk", "events duplicated, as the handlers saw them", "", "<=", 0),
    "p99": Target("sdk", "p99 close -> recovered", "s", "<=", 5.0),
}
NOTIFY_SHARE = 0.1
START_RATE = 400.0
"""Clients the fleets start per second together at the beginning (a site's arrivals)."""
CLIENTS_PER_FLEET = 400
START_ATTEMPTS = 3
"""Starts of a restarted node before the run fails."""
SAMPLE_SECONDS = 0.1
ACCEPTED = "ap_accepted_upgrades_total"
REFUSED = "ap_refused_upgrades_total"
SESSIONS = "ap_connections"


@dataclass
class Fleet:
    process: multiprocessing.process.BaseProcess
    commands: Any
    status: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None


@dataclass
class Node:
    name: str
    proc: Proc
    generation: int = 0


@dataclass
class Samples:
    """Each node generation's accepted and refused counters over time."""

    accepted: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)
    refused: dict[tuple[str, int], float] = field(default_factory=dict)
    sessions: dict[tuple[str, int], float] = field(default_factory=dict)  # the latest gauge


@dataclass
class Publishing:
    accepted: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    published: int = 0
    failures: int = 0
    # What each failed attempt got (a 503, a refused or lost answer): every one but
    # a failed event's last was followed by a retry.
    failed_attempts: Counter[str] = field(default_factory=Counter)

    @property
    def retries(self) -> int:
        return sum(self.failed_attempts.values()) - self.failures


def plans(run: Run, urls: list[str]) -> list[ClientPlan]:
    options = run.options
    games = game_refs(options.games)
    per = min(options.games_per_conn, len(games))
    out = []
    for index in range(options.connections):
        first = index % len(urls)
        order = urls[first:] + urls[:first]  # its own node first
        picked = tuple(games[g] for g in run.rng.sample(range(len(games)), per))
        out.append(ClientPlan(f"sdk-u{index}", picked, tuple(order)))
    return out


def fleet_count(workers: int, clients: int) -> int:
    """At least ``--workers`` fleets, and no more than ``CLIENTS_PER_FLEET`` clients in
    one: a thousand clients in one Python process queue behind each other for its one
    core, and the time they wait is a generator artefact, not a recovery figure."""
    return max(1, workers, -(-clients // CLIENTS_PER_FLEET))


def start_fleets(run: Run, all_plans: list[ClientPlan]) -> tuple[list[Fleet], Any]:
    context = multiprocessing.get_context("spawn")
    count = fleet_count(run.options.workers, len(all_plans))
    reports_out, reports_in = None, None
    fleets: list[Fleet] = []
    receivers = []
    for index in range(count):
        commands_in, commands_out = context.Pipe(duplex=False)
        reports_in, reports_out = context.Pipe(duplex=False)
        spec = FleetSpec(
            index=index,
            plans=tuple(all_plans[index::count]),
            jwt_secret=run.secrets.jwt,
            start_rate=START_RATE / count,
            lifetime=run.options.timeout + 120,
        )
        process = context.Process(
            target=fleet_main, args=(spec, commands_in, reports_out), name=f"sdk-fleet-{index}"
        )
        process.daemon = True
        process.start()
        commands_in.close()
        reports_out.close()
        fleets.append(Fleet(process, commands_out))
        receivers.append(reports_in)
    return fleets, receivers


def read_reports(
    fleets: list[Fleet], receivers: list[Any], loop: asyncio.AbstractEventLoop
) -> None:
    """One thread per fleet: its reports land on the fleet, on the loop's thread."""

    def apply(fleet: Fleet, message: dict[str, Any]) -> None:
        if message["op"] == "status":
            fleet.status = message
        elif message["op"] == "result":
            fleet.result = message

    def reader(fleet: Fleet, receiver: Any) -> None:
        while True:
            try:
                message = receiver.recv()
            except (EOFError, OSError):
                return
            loop.call_soon_threadsafe(apply, fleet, message)
            if message["op"] == "stopped":
                return

    for fleet, receiver in zip(fleets, receivers, strict=True):
        threading.Thread(target=reader, args=(fleet, receiver), daemon=True).start()


def connected(fleets: list[Fleet]) -> int:
    return sum(f.status.get("connected", 0) for f in fleets)


async def until(run: Run, label: str, done: Callable[[], int], total: int, limit: float) -> float:
    started = time.monotonic()
    while (count := done()) < total:
        if time.monotonic() - started > limit:
            raise RuntimeError(f"sdk: {label}: {count}/{total} after {limit:.0f} s")
        run.progress.update(label, count, total)
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def sample(nodes: list[Node], samples: Samples, stop: asyncio.Event) -> None:
    """Every node's counters every 0.1 s; a node that is down is skipped."""
    timeout = aiohttp.ClientTimeout(total=1)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(node: Node) -> None:
            key = (node.name, node.generation)
            url = f"http://{HOST}:{node.proc.http_port}/metrics"
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url) as response:
                    text = await response.text()
                at = time.monotonic()
                for line in text.splitlines():
                    if line.startswith(ACCEPTED + " "):
                        samples.accepted.setdefault(key, []).append((at, float(line.split()[1])))
                    elif line.startswith(REFUSED + " "):
                        samples.refused[key] = float(line.split()[1])
                    elif line.startswith(SESSIONS + " "):
                        samples.sessions[key] = float(line.split()[1])

        while not stop.is_set():
            await asyncio.gather(*(one(node) for node in nodes))
            await asyncio.sleep(SAMPLE_SECONDS)


def busiest_second(points: list[tuple[float, float]]) -> float:
    """Most accepts between two samples at most one second apart (a lower bound of the
    busiest one-second window, short of it by at most one sample period's accepts)."""
    best = 0.0
    start = 0
    for end in range(len(points)):
        while points[end][0] - points[start][0] > 1.0:
            start += 1
        best = max(best, points[end][1] - points[start][1])
    return best


async def publish(
    nodes: list[Node],
    secret: str,
    rate: float,
    games: list[tuple[str, str]],
    users: list[str],
    out: Publishing,
    stop: asyncio.Event,
    rng: random.Random,
) -> None:
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    run_id = uuid.uuid4().hex[:8]
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:

        async def post(serial: int, body: bytes) -> None:
            # As a publisher should: the event is named, so a retry after a lost
            # answer (a node killed between its append and its reply) is the same
            # event, answered with its first position, not a second one.
            named = {**headers, "Idempotency-Key": f"sdk-{run_id}-{serial}"}
            for attempt in range(len(nodes)):
                node = nodes[(serial + attempt) % len(nodes)]
                url = f"http://{HOST}:{node.proc.http_port}/publish"
                try:
                    async with http.post(url, data=body, headers=named) as response:
                        reply = await response.json(content_type=None)
                        if response.status == 202 and reply.get("positions"):
                            for stream, position in reply["positions"].items():
                                out.accepted.setdefault(stream, []).append(
                                    (position["epoch"], position["offset"])
                                )
                            return
                        cause = f"{response.status} {reply.get('error', 'no positions')}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    cause = type(exc).__name__
                out.failed_attempts[cause] += 1
            out.failures += 1

        start = time.monotonic()
        serial = 0
        while not stop.is_set():
            delay = start + serial / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if rng.random() < NOTIFY_SHARE:
                body = {
                    "verb": "notification",
                    "users": [rng.choice(users)],
                    "payload": {"n": serial},
                }
            else:
                meta, game_id = rng.choice(games)
                body = {"verb": "game", "payload": {"meta": meta, "id": game_id, "n": serial}}
            task = asyncio.create_task(post(serial, json.dumps(body).encode()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            out.published += 1
            serial += 1
        if tasks:
            await asyncio.wait(tasks, timeout=15)


async def sdk(run: Run) -> Result:
    options = run.options
    count = options.connections
    rate = options.rate or 40.0
    load_before = os.getloadavg()
    run.progress.log("starting redis-server and moto_server")
    redis_proc, redis_url = await start_redis()
    run.track(redis_proc)
    moto_proc, endpoint = await start_moto()
    run.procs.append(moto_proc)  # not under test: any CPU
    table = f"loadtest-{uuid.uuid4().hex[:8]}"
    await create_table(endpoint, table)
    node_args = [
        f"--accept-rate={options.accept_rate:g}",
        f"--drain-seconds={options.drain_seconds:g}",
        *options.server_args,
    ]

    async def start_node(name: str, ports: tuple[int, int] | None = None) -> Proc:
        proc = await start_ours(
            name,
            run.secrets,
            debounce_ms=options.debounce_ms,
            extra_args=node_args,
            cluster=(redis_url, endpoint, table),
            ports=ports,
        )
        return run.track(proc)

    nodes = [Node(f"sdk-n{i}", await start_node(f"sdk-n{i}")) for i in (1, 2, 3)]
    run.add_server("sdk", [n.proc for n in nodes])
    urls = [f"ws://{HOST}:{n.proc.ws_port}/" for n in nodes]
    all_plans = plans(run, urls)
    games = game_refs(options.games)
    users = [p.user_id for p in all_plans]

    samples, publishing = Samples(), Publishing()
    stop_sampling, stop_publishing = asyncio.Event(), asyncio.Event()
    sampler = asyncio.create_task(sample(nodes, samples, stop_sampling))
    fleets, receivers = start_fleets(run, all_plans)
    read_reports(fleets, receivers, asyncio.get_running_loop())
    reconnect_limit = options.connect_timeout + 120.0
    phases: dict[str, Any] = {}
    publisher: asyncio.Task[None] | None = None

    def roles(live: list[Node]) -> dict[str, list[int]]:
        fleet_pids = [f.process.pid for f in fleets if f.process.pid is not None]
        return {
            "nodes": [n.proc.pid for n in live],
            "redis": [redis_proc.pid],
            "clients": fleet_pids,
        }

    async def restart(node: Node, kill: bool) -> None:
        ports = (node.proc.ws_port, node.proc.http_port)
        if kill:
            node.proc.process.kill()
            node.proc.process.wait(timeout=10)
            await asyncio.sleep(2.0)
        else:
            await asyncio.to_thread(node.proc.stop, options.drain_seconds + 30)
        run.procs.remove(node.proc)
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                node.proc = await start_node(node.name, ports)
                break
            except StartError as exc:
                # A loaded moto can time out the start's table check while it
                # writes the moved clients' rows; the clients are elsewhere by now.
                if attempt == START_ATTEMPTS:
                    raise
                first = str(exc).splitlines()[-1][:200]
                run.progress.log(f"{node.name} did not start ({first}); starting it again")
                phases["node_start_retries"] = phases.get("node_start_retries", 0) + 1
        node.generation += 1
        run.add_server("sdk", [n.proc for n in nodes])

    begun = time.monotonic()
    try:
        phases["connect_s"] = round(
            await until(
                run, "clients connected", lambda: connected(fleets), count, reconnect_limit
            ),
            2,
        )
        run.activate("sdk", "steady")
        publisher = asyncio.create_task(
            publish(
                nodes,
                run.secrets.publish,
                rate,
                games,
                users,
                publishing,
                stop_publishing,
                random.Random(options.seed),
            )
        )
        await asyncio.sleep(options.duration)
        for node in nodes:
            run.progress.log(f"rolling restart: {node.name} (SIGTERM, drain, start)")
            started = time.monotonic()
            others = roles([n for n in nodes if n is not node])
            usage = _usage(others)
            await restart(node, kill=False)
            await until(
                run,
                f"reconnected after {node.name}",
                lambda: connected(fleets),
                count,
                reconnect_limit,
            )
            phases[f"restart_{node.name}"] = _spent(usage, others, time.monotonic() - started)
        victim = max(nodes, key=lambda n: samples.sessions.get((n.name, n.generation), 0.0))
        held = samples.sessions.get((victim.name, victim.generation), 0.0)
        run.progress.log(f"kill -9 {victim.name} ({held:.0f} clients), started again 2 s later")
        phases["killed_node_clients"] = held
        started = time.monotonic()
        survivors = roles([n for n in nodes if n is not victim])
        usage = _usage(survivors)
        await restart(victim, kill=True)
        await until(
            run, "reconnected after the kill", lambda: connected(fleets), count, reconnect_limit
        )
        phases["kill"] = _spent(usage, survivors, time.monotonic() - started)
        await asyncio.sleep(max(2.0, options.duration / 2))
        stop_publishing.set()
        await publisher
        publisher = None
        await asyncio.sleep(3.0)  # the last events reach every handler
        await until(run, "clients connected at the end", lambda: connected(fleets), count, 60)
        accepted = {s: list(v) for s, v in publishing.accepted.items()}
        for fleet in fleets:
            fleet.commands.send({"op": "finish", "accepted": accepted})
        await until(
            run,
            "fleet results",
            lambda: sum(f.result is not None for f in fleets),
            len(fleets),
            120,
        )
        phases["fleet_cpu_s"] = round(sum(_cpu(f) for f in fleets), 1)
        phases["run_s"] = round(time.monotonic() - begun, 1)
    finally:
        stop_publishing.set()
        if publisher is not None:
            with contextlib.suppress(Exception):
                await publisher
        stop_sampling.set()
        with contextlib.suppress(Exception):
            await sampler
        for fleet in fleets:
            with contextlib.suppress(OSError):
                fleet.commands.send({"op": "stop"})
        for fleet in fleets:
            await asyncio.to_thread(fleet.process.join, 30)
            if fleet.process.is_alive():
                fleet.process.kill()
    return _figures(run, fleets, samples, publishing, phases, rate, load_before)


def _usage(pids: dict[str, list[int]]) -> dict[str, dict[int, tuple[float, float]]]:
    """CPU seconds and seconds waiting for a CPU, per live process, by role."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for role, role_pids in pids.items():
        out[role] = {}
        for pid in role_pids:
            with contextlib.suppress(OSError, ValueError, IndexError):
                out[role][pid] = (cpu_seconds(pid), run_delay_seconds(pid))
    return out


def _spent(
    before: dict[str, dict[int, tuple[float, float]]], pids: dict[str, list[int]], wall: float
) -> dict[str, float]:
    """What each role's processes alive through a phase used of the CPUs, and how long
    they were runnable but waited for one (held by other processes of the machine)."""
    after = _usage(pids)
    spent: dict[str, float] = {"wall_s": round(wall, 2)}
    for role, now in after.items():
        then = before.get(role, {})
        live = [pid for pid in now if pid in then]
        spent[f"{role}_cpu_s"] = round(sum(now[p][0] - then[p][0] for p in live), 2)
        spent[f"{role}_waiting_for_a_cpu_s"] = round(sum(now[p][1] - then[p][1] for p in live), 2)
    return spent


def _cpu(fleet: Fleet) -> float:
    pid = fleet.process.pid
    if pid is None:
        return 0.0
    with contextlib.suppress(OSError, ValueError):
        return cpu_seconds(pid)
    return 0.0


def _breakdown(outages: Any, planned: Any, failures: Any, pct: Any) -> dict[str, Any]:
    """Each outage split into the SDK's own planned waits (0-3 s after a 1012, the
    backoff after a failure) and the rest: connecting, the subscribe and its
    recovery, and every wait for a CPU on either side; for all outages and for
    the slowest 1%."""
    if not outages.size:
        return {}
    rest = outages - planned
    slow = outages >= np.percentile(outages, 99)

    def part(mask: Any) -> dict[str, float]:
        return {
            "outages": int(mask.sum()),
            "planned_wait_mean_s": round(float(planned[mask].mean()), 3),
            "rest_mean_s": round(float(rest[mask].mean()), 3),
            "failed_attempts_mean": round(float(failures[mask].mean()), 2),
        }

    return {
        "planned_wait_s": {"p50": pct(planned, 50), "p99": pct(planned, 99)},
        "rest_s": {"p50": pct(rest, 50), "p99": pct(rest, 99)},
        "with_a_failed_attempt": int((failures > 0).sum()),
        "all": part(np.ones_like(outages, dtype=bool)),
        "slowest_1pct": part(slow),
    }


def _merged(counts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in counts:
        for key, n in one.items():
            total[key] = total.get(key, 0) + n
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def _figures(
    run: Run,
    fleets: list[Fleet],
    samples: Samples,
    publishing: Publishing,
    phases: dict[str, Any],
    rate: float,
    load_before: tuple[float, float, float],
) -> Result:
    options = run.options
    results = [f.result for f in fleets if f.result is not None]
    records = [tuple(o) for r in results for o in r["outages_s"]]
    pairs = [(int(o[0]), float(o[1])) for o in records]
    outages = np.array([s for _, s in pairs], dtype=float)
    planned = np.array([float(o[3]) for o in records], dtype=float)
    failures = np.array([int(o[2]) for o in records], dtype=float)
    lags = np.array([v for r in results for v in r["loop_lag_s"]], dtype=float)

    def pct(values: Any, q: float) -> float:
        return round(float(np.percentile(values, q)), 3) if len(values) else float("nan")

    by_code = {
        str(code): {
            "outages": len(values),
            "p50": pct(values, 50),
            "p99": pct(values, 99),
            "max": round(max(values), 3),
        }
        for code in sorted({c for c, _ in pairs})
        for values in [[s for c, s in pairs if c == code]]
    }

    accepts = {
        f"{name}#{generation}": busiest_second(points)
        for (name, generation), points in sorted(samples.accepted.items())
    }
    busiest = max(accepts.values(), default=float("nan"))
    resyncs: dict[str, int] = {}
    codes: dict[str, int] = {}
    for r in results:
        for reason, n in r["resyncs"].items():
            resyncs[reason] = resyncs.get(reason, 0) + n
        for code, n in r["close_codes"].items():
            codes[code] = codes.get(code, 0) + n
    missed = sum(r["missed"] for r in results)
    duplicated = sum(r["duplicated"] for r in results)
    accepted_events = sum(len(v) for v in publishing.accepted.values())
    figures = {
        "clients": options.connections,
        "nodes": 3,
        "games": options.games,
        "games_per_client": options.games_per_conn,
        "publish_rate": rate,
        "accept_rate": options.accept_rate,
        "drain_seconds": options.drain_seconds,
        "published": publishing.published,
        "accepted_events": accepted_events,
        "publish_failures": publishing.failures,
        "publish_retries": publishing.retries,
        "publish_failed_attempts": dict(publishing.failed_attempts),
        "deliveries_expected": sum(r["expected"] for r in results),
        "missed": missed,
        "duplicated": duplicated,
        "unexpected": sum(r["unexpected"] for r in results),
        "resyncs": resyncs,
        "close_codes": codes,
        "outages": int(outages.size),
        "close_to_recovered_s": {
            "p50": pct(outages, 50),
            "p90": pct(outages, 90),
            "p99": pct(outages, 99),
            "max": round(float(outages.max()), 3) if outages.size else float("nan"),
        },
        "close_to_recovered_by_first_code_s": by_code,
        "where_the_time_goes": _breakdown(outages, planned, failures, pct),
        "failed_attempts_by_reason": _merged(r["failed_attempts"] for r in results),
        "generator": {
            "processes": len(fleets),
            "cpu_s": phases.get("fleet_cpu_s"),
            "cores": round(phases["fleet_cpu_s"] / phases["run_s"], 2)
            if phases.get("run_s")
            else None,
            "loop_lag_s": {"p50": pct(lags, 50), "p99": pct(lags, 99), "max": pct(lags, 100)},
        },
        "accepts_busiest_second": accepts,
        "refused_upgrades": {f"{n}#{g}": v for (n, g), v in sorted(samples.refused.items())},
        "phases_s": phases,
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
    }
    has_events = accepted_events > 0 and bool(results)
    targets = [
        check(TARGETS["missed"], missed if has_events else float("nan"), options.connections),
        check(
            TARGETS["duplicated"], duplicated if has_events else float("nan"), options.connections
        ),
        check(TARGETS["p99"], figures["close_to_recovered_s"]["p99"], options.connections),
        check(
            Target("sdk", "accepts in any one second, busiest node", "", "<=", options.accept_rate),
            busiest,
            options.connections,
            f"sampled every {SAMPLE_SECONDS:g} s",
        ),
    ]
    return {"servers": {"sdk": figures}, "targets": targets}
