"""The run: processes under test, the worker pool, sampling, and the phases all scenarios share."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.clients.sim import WATCH_REPEATS, ClientSpec
from loadtest.harness.pool import WorkerPool
from loadtest.harness.procstat import cpu_seconds
from loadtest.harness.progress import Progress
from loadtest.harness.servers import (
    HOST,
    Proc,
    Secrets,
    create_table,
    start_baseline,
    start_moto,
    start_ours,
    start_redis,
)
from loadtest.report.stats import Histogram

SAMPLE_INTERVAL = 0.25
SETTLED_CORES = 0.05
"""A server using less CPU than this is done with the earlier phases' work."""
SETTLE_LIMIT_S = 120.0
GAME_META = "loadtest"
REDIS_NODE = "ours+redis"


@dataclass
class Options:
    """Everything a scenario needs to know; filled from the command line."""

    scenario: str
    connections: int = 2000
    workers: int = 2
    duration: float = 10.0
    games: int = 200
    games_per_conn: int = 10
    bots: float = 0.1
    rate: float | None = None
    saturation_seconds: float = 5.0
    rounds: int = 3
    warmup_seconds: float = 2.0
    publishers: int = 16
    ramp: int = 100
    churn: float = 20.0
    hold: float | None = None
    debounce_ms: int = 1000
    full_observers: int = 2
    connect_timeout: float = 15.0
    storm_timeout: float = 60.0
    nodes: int = 2
    failover_seconds: float = 8.0
    """cluster: how long events keep flowing after a Redis Cluster primary is killed."""
    buses: tuple[str, ...] = ("embedded", "redis")
    """Streams scenarios: run a node on each of these buses."""
    away_events: int = 10
    """Recovery: events published to each game while the clients are away."""
    observers: int | None = None
    baseline: bool = True
    server_args: list[str] = field(default_factory=list)
    server_cpus: list[int] = field(default_factory=list)
    """CPUs for the processes under test; the generator gets the others (empty: no pinning)."""
    progress: bool = True
    timeout: float = 1800.0
    seed: int = 1
    attackers: float = 1.0
    """abuse: scale of each attack's attacker count."""
    attacks: list[str] = field(default_factory=list)
    """abuse: run only these attacks (default: all)."""
    abuse_pad: int = 2000
    """abuse: payload bytes added to each steady event, so slow readers fill up."""
    accept_rate: float = 500.0
    """sdk: each node's --accept-rate, and the limit its accepts per second are checked against."""
    drain_seconds: float = 10.0
    """sdk: each node's --drain-seconds in the rolling restart."""
    bot_queue: bool = False
    """bots: feed the turns through today's bot queue on moto (``scenarios/bots_queue.py``)."""


@dataclass(frozen=True)
class Meter:
    """CPU and wall clock at one instant: each server's, and the generator's."""

    wall: float
    server_cpu: dict[str, float]
    server_wait: dict[str, float]
    """Seconds each server was runnable but waited for a CPU (other processes had it)."""
    generator_cpu: float
    worker_cpu: tuple[float, ...]
    parent_cpu: float


def game_refs(count: int) -> list[tuple[str, str]]:
    return [(GAME_META, f"g{index}") for index in range(count)]


def browser_specs(
    count: int,
    games: Sequence[tuple[str, str]],
    per_conn: int,
    bots: float,
    rng: random.Random,
    prefix: str = "u",
) -> tuple[list[ClientSpec], list[int]]:
    """``count`` clients watching ``per_conn`` random games each; a share of them bots.

    Returns the specs and, per game, how many clients watch it.
    """
    watchers = [0] * len(games)
    bot_count = round(count * bots)
    bot_every = count / bot_count if bot_count else math.inf
    specs: list[ClientSpec] = []
    per_conn = min(per_conn, len(games))
    next_bot = 0.0
    for index in range(count):
        is_bot = bot_count > 0 and index >= next_bot and index < count
        if is_bot:
            next_bot += bot_every
        picked = rng.sample(range(len(games)), per_conn) if per_conn else []
        for game in picked:
            watchers[game] += 1
        specs.append(
            ClientSpec(
                user_id=f"{'bot' if is_bot else prefix}{index}",
                bot=is_bot,
                games=tuple(games[g] for g in picked),
            )
        )
    return specs, watchers


class Run:
    """One invocation of ``python -m loadtest``: owns every process it starts.

    Servers under measurement are registered under a label (``baseline``,
    ``ours``, ``cluster``); the sampler records each one's RSS and CPU, and
    which one the current stage is driving.
    """

    def __init__(self, options: Options, progress: Progress, extra_workers: int = 0) -> None:
        self.options = options
        self.progress = progress
        self.secrets = Secrets.generate()
        self.rng = random.Random(options.seed)
        self.pool = WorkerPool(
            options.workers + extra_workers, self.secrets.jwt, lifetime=options.timeout + 120
        )
        self.observer_workers = list(range(options.workers))
        self.driver_worker = options.workers if extra_workers else None
        self.procs: list[Proc] = []
        self.servers: dict[str, list[Proc]] = {}
        self.active = ""
        self.stage_kind = ""
        self.base_subscribed = 0
        self.series: list[dict[str, Any]] = []
        self.stage: tuple[str, Callable[[], float], float] | None = None
        self.started = time.time()
        self._on_exit: list[Callable[[], None]] = []
        self._sampler: asyncio.Task[None] | None = None
        self._meter0: Meter | None = None
        self.server_cpus: set[int] = set()
        self.generator_cpus: set[int] = set()
        self.redis_url = ""

    # --- lifecycle ----------------------------------------------------------

    async def __aenter__(self) -> Run:
        self._pin_generator()
        self.pool.start()
        self.pool.attach()
        await self.pool.ready()
        self._meter0 = self.meter()
        self._sampler = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        self.progress.clear()
        for proc in reversed(self.procs):
            proc.stop()
        for cleanup in reversed(self._on_exit):
            cleanup()
        self.pool.stop()

    def on_exit(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` when the run ends, after the tracked processes are stopped."""
        self._on_exit.append(cleanup)

    def _pin_generator(self) -> None:
        """Keep the generator (this process and its workers) off the servers' CPUs.

        On a small machine the scheduler otherwise runs a server and the
        process that talks to it on the same CPU, and neither gets a whole one.
        """
        wanted = set(self.options.server_cpus)
        if not wanted or not hasattr(os, "sched_setaffinity"):
            return
        available = os.sched_getaffinity(0)
        servers = wanted & available
        rest = available - servers
        if not servers or not rest:
            self.progress.log(f"not pinning: CPUs {sorted(available)} cannot be split")
            return
        self.server_cpus, self.generator_cpus = servers, rest
        os.sched_setaffinity(0, rest)  # the workers inherit it
        self.progress.log(f"servers on CPUs {sorted(servers)}, generator on CPUs {sorted(rest)}")

    def track(self, proc: Proc) -> Proc:
        """Own a process under test: pin it to the servers' CPUs, stop it at the end."""
        if self.server_cpus:
            try:
                os.sched_setaffinity(proc.pid, self.server_cpus)
            except OSError as exc:
                self.progress.log(f"cannot pin {proc.name}: {exc}")
        self.procs.append(proc)
        return proc

    def add_server(self, label: str, procs: Sequence[Proc]) -> None:
        self.servers[label] = list(procs)

    def activate(self, label: str, kind: str) -> None:
        """The next stage drives ``label``'s server; ``kind`` names the stage."""
        self.active = label
        self.stage_kind = kind
        if kind == "connect":
            self.base_subscribed = self.pool.total("subscribed")

    async def start_server(self, kind: str, extra_args: Sequence[str] = ()) -> Proc:
        """Start ``ours``, ``ours+redis``, ``baseline``, or our server under another
        label with ``extra_args``, and register it for measurement.

        ``ours+redis`` is one cluster node: the Redis bus, and DynamoDB (moto,
        which the Redis bus needs as its shared store); ``redis-server`` and
        ``moto_server`` are registered as the servers ``redis`` and ``moto``.
        """
        self.progress.log(f"starting {kind} server")
        if kind == "baseline":
            proc = await start_baseline(self.secrets)
        elif kind == REDIS_NODE:
            redis_proc, url = await start_redis()
            self.add_server("redis", [self.track(redis_proc)])
            moto_proc, endpoint = await start_moto()
            self.add_server("moto", [self.track(moto_proc)])
            table = f"loadtest-{uuid.uuid4().hex[:8]}"
            await create_table(endpoint, table)
            self.redis_url = url
            proc = await start_ours(
                "ours-redis",
                self.secrets,
                debounce_ms=self.options.debounce_ms,
                extra_args=self.options.server_args,
                cluster=(url, endpoint, table),
            )
        else:
            proc = await start_ours(
                "ours",
                self.secrets,
                debounce_ms=self.options.debounce_ms,
                extra_args=[*self.options.server_args, *extra_args],
            )
        self.track(proc)
        self.add_server(kind, [proc])
        return proc

    async def start_cluster_node(
        self,
        name: str,
        cluster: tuple[str, str, str],
        extra_args: list[str],
        ports: tuple[int, int] | None = None,
    ) -> Proc:
        """One of our cluster nodes (``cluster``: Redis URL, DynamoDB endpoint, table),
        owned by this run; ``ports`` restarts a killed node where its clients look."""
        proc = await start_ours(
            name,
            self.secrets,
            debounce_ms=self.options.debounce_ms,
            extra_args=extra_args,
            cluster=cluster,
            ports=ports,
        )
        return self.track(proc)

    async def stop_servers(self, *labels: str) -> None:
        """Drop every client, then stop these servers."""
        await self.pool.broadcast({"op": "close_all"}, limit=30)
        await self.pool.broadcast({"op": "reset"}, limit=30)
        for label in labels:
            for proc in self.servers.pop(label, []):
                proc.stop()
                if proc in self.procs:
                    self.procs.remove(proc)

    # --- measuring ----------------------------------------------------------

    def server_cpu(self, label: str) -> float:
        total = 0.0
        for proc in self.servers.get(label, []):
            with contextlib.suppress(OSError, ValueError):
                total += proc.cpu()
        return total

    def server_wait(self, label: str) -> float:
        total = 0.0
        for proc in self.servers.get(label, []):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += proc.cpu_wait()
        return total

    def server_rss(self, label: str) -> int:
        total = 0
        for proc in self.servers.get(label, []):
            with contextlib.suppress(OSError, ValueError):
                total += proc.rss()
        return total

    def meter(self) -> Meter:
        workers = tuple(self.pool.cpu_seconds())
        parent = cpu_seconds(os.getpid())
        return Meter(
            wall=time.time(),
            server_cpu={label: self.server_cpu(label) for label in self.servers},
            server_wait={label: self.server_wait(label) for label in self.servers},
            generator_cpu=sum(workers) + parent,
            worker_cpu=workers,
            parent_cpu=parent,
        )

    def interval(self, start: Meter, end: Meter, label: str | None = None) -> dict[str, float]:
        """Wall time, the server's CPU (if ``label``) and the generator's CPU between meters.

        ``generator_share`` is the generator's CPU over what its CPUs could
        give; near 1 the generator, not the server, may be the limit.
        """
        wall = max(1e-9, end.wall - start.wall)
        generator = end.generator_cpu - start.generator_cpu
        busiest = max(
            (b - a for a, b in zip(start.worker_cpu, end.worker_cpu, strict=False)),
            default=0.0,
        )
        cpus = len(self.generator_cpus) or len(os.sched_getaffinity(0))
        out = {
            "wall_s": round(wall, 3),
            "generator_cpu_s": round(generator, 3),
            "generator_cores": round(generator / wall, 3),
            "generator_share": round(generator / wall / cpus, 3),
            "generator_busiest_process": round(
                max(busiest, end.parent_cpu - start.parent_cpu) / wall, 3
            ),
        }
        if label is not None:
            server = end.server_cpu.get(label, 0.0) - start.server_cpu.get(label, 0.0)
            out["server_cpu_s"] = round(server, 3)
            out["server_cores"] = round(server / wall, 3)
            waited = end.server_wait.get(label, 0.0) - start.server_wait.get(label, 0.0)
            out["server_cpu_wait_s"] = round(waited, 3)
        return out

    def generator_total(self) -> dict[str, float]:
        assert self._meter0 is not None
        return self.interval(self._meter0, self.meter())

    async def rss_settled(self, label: str, samples: int = 3, gap: float = 0.3) -> int:
        """The median of a few RSS readings of a server."""
        values = []
        for index in range(samples):
            if index:
                await asyncio.sleep(gap)
            values.append(self.server_rss(label))
        return int(statistics.median(values))

    async def settle(
        self,
        label: str,
        *,
        cores: float = SETTLED_CORES,
        quiet_seconds: int = 1,
        limit: float = SETTLE_LIMIT_S,
    ) -> float:
        """Wait until a server is idle (under ``cores`` for ``quiet_seconds``
        seconds in a row, or ``limit`` at most); returns the seconds waited.

        A phase leaves write-behind work queued (on a cluster node, a claim and a
        DynamoDB ``lastSeen`` write per user through moto, seconds of it): it must
        be billed neither to the next phase on that node nor to another server's.
        """
        start = last_at = time.monotonic()
        last = self.server_cpu(label)
        quiet = 0
        while last_at - start < limit:
            await self.wait_timed(f"{label}: waiting for the node to settle", 1.0)
            now, now_at = self.server_cpu(label), time.monotonic()
            quiet = quiet + 1 if now - last < cores * (now_at - last_at) else 0
            if quiet >= quiet_seconds:
                break
            last, last_at = now, now_at
        return time.monotonic() - start

    async def _sample(self) -> None:
        while True:
            try:
                self._take_sample()
            except Exception as exc:  # sampling must never end the run
                self.progress.log(f"sampler: {exc}")
            await asyncio.sleep(SAMPLE_INTERVAL)

    def _take_sample(self) -> None:
        totals = self.pool.totals()
        subscribed = totals.get("subscribed", 0)
        self.series.append(
            {
                "t": round(time.time() - self.started, 3),
                "active": self.active,
                "stage": self.stage_kind,
                "connected": totals.get("connected", 0),
                "subscribed": subscribed,
                "subscribed_active": subscribed - self.base_subscribed,
                "game_events": totals.get("game_events", 0),
                "deltas": totals.get("deltas", 0),
                "frames": totals.get("frames", 0),
                "rss_bytes": {label: self.server_rss(label) for label in self.servers},
                "server_cpu_s": {label: round(self.server_cpu(label), 3) for label in self.servers},
            }
        )
        if self.stage is not None:
            label, done, total = self.stage
            detail = (
                f"conn {totals.get('connected', 0)} "
                f"sub {subscribed} "
                f"ev {totals.get('game_events', 0)} "
                f"Δ {totals.get('deltas', 0)} "
                f"fail {totals.get('connect_failures', 0)} "
                f"gaps {totals.get('gaps', 0)}"
            )
            self.progress.update(label, done(), total, detail)

    async def wait_for(
        self,
        label: str,
        done: Callable[[], float],
        total: float,
        limit: float,
    ) -> bool:
        """Show progress until ``done() >= total`` or ``limit`` seconds; True if reached."""
        self.stage = (label, done, total)
        deadline = time.monotonic() + limit
        try:
            while time.monotonic() < deadline:
                if done() >= total:
                    return True
                await asyncio.sleep(0.05)
            return done() >= total
        finally:
            self.stage = None

    async def wait_timed(self, label: str, seconds: float) -> None:
        start = time.monotonic()
        await self.wait_for(label, lambda: time.monotonic() - start, seconds, seconds + 1)

    # --- shared phases ------------------------------------------------------

    def split(self, specs: Sequence[ClientSpec]) -> list[list[ClientSpec]]:
        workers = len(self.observer_workers)
        return [list(specs[index::workers]) for index in range(workers)]

    async def connect(
        self,
        specs: Sequence[ClientSpec],
        endpoints: Sequence[tuple[str, int]],
        *,
        label: str,
        concurrency: int | None,
        at_ns: int | None = None,
        wait_replies: bool = True,
    ) -> None:
        """Hand the specs to the workers; with ``wait_replies``, until all connected."""
        parts = self.split(specs)
        for index, part in zip(self.observer_workers, parts, strict=True):
            self.pool.send(
                index,
                {
                    "op": "connect",
                    "specs": part,
                    "endpoints": list(endpoints),
                    "concurrency": concurrency,
                    "at_ns": at_ns,
                    "timeout": self.options.connect_timeout,
                },
            )
        if not wait_replies:
            return
        target = len(specs)
        already = self.pool.total("subscribed")
        await self.wait_for(
            label,
            lambda: self.pool.total("subscribed") - already,
            target,
            limit=self.options.connect_timeout + target / 50 + 30,
        )
        await self.replies("connect", limit=self.options.connect_timeout * 10)

    async def replies(self, op: str, limit: float) -> list[dict[str, Any]]:
        return list(
            await asyncio.gather(
                *(self.pool.reply(index, op, limit) for index in self.observer_workers)
            )
        )

    async def settle_watch(self) -> None:
        """Let the browsers' repeated watchGames land before measuring."""
        await self.wait_timed("settling", max(WATCH_REPEATS) + 0.6)

    async def drain(self, expected: int, label: str = "draining", quiet: float = 5.0) -> None:
        """Wait until every expected game event arrived, or none arrived for ``quiet`` s.

        ``quiet`` costs nothing when all arrive; it is what separates "late" from
        "lost", so it is long: a starved machine pauses deliveries for over a second."""
        last = -1
        still_since = time.monotonic()
        deadline = time.monotonic() + 20
        self.stage = (label, lambda: self.pool.total("game_events"), expected)
        try:
            while time.monotonic() < deadline:
                await self.pool.fresh_ticks()
                got = self.pool.total("game_events")
                if got >= expected:
                    return
                if got != last:
                    last, still_since = got, time.monotonic()
                elif time.monotonic() - still_since >= quiet:
                    return
        finally:
            self.stage = None

    async def collect(self, indexes: Sequence[int] | None = None) -> list[dict[str, Any]]:
        chosen = list(indexes) if indexes is not None else list(range(self.pool.size))
        return await self.pool.command(chosen, [{"op": "collect"}] * len(chosen), limit=60)


def merge_latency(results: Sequence[dict[str, Any]]) -> dict[int, Histogram]:
    merged: dict[int, Histogram] = {}
    for result in results:
        for phase, wire in result["latency"].items():
            merged.setdefault(int(phase), Histogram()).merge(Histogram.from_wire(wire))
    return merged


def merge_counters(results: Sequence[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for result in results:
        for name, value in result["counters"].items():
            total[name] = total.get(name, 0) + int(value)
    return total


CONNECT_FAILURE_CAUSES = (
    "refused",
    "reset",
    "timeouts_tcp",
    "timeouts_handshake",
    "shed",
    "other",
)


def failures_by_cause(counters: dict[str, int]) -> dict[str, int]:
    """Failed connect attempts by cause (``Tally.connect_*``); they sum to ``connect_failures``."""
    return {cause: counters.get(f"connect_{cause}", 0) for cause in CONNECT_FAILURE_CAUSES}


def ws_endpoint(proc: Proc) -> tuple[str, int]:
    return (HOST, proc.ws_port)


def http_endpoint(proc: Proc) -> tuple[str, int]:
    return (HOST, proc.http_port)
