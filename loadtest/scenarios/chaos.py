"""``python -m loadtest chaos``: minutes of random faults, and nothing lost, doubled or skipped.

Three nodes, DynamoDB (moto) behind :class:`~loadtest.harness.faults.DynamoFaultProxy`,
and one of two Redis topologies:

- ``redis``: one ``redis-server`` behind :class:`~loadtest.harness.faults.TcpFaultProxy`
  (latency, blackhole, connection cuts), restarted now and then without its data;
- ``cluster``: the six-instance Redis Cluster of ``loadtest/harness/redis_cluster.py``,
  a primary killed with ``-9`` now and then (its replica takes over, it comes back as a
  replica), a primary frozen (``SIGSTOP``) for less than the cluster's node timeout (a
  blackhole) or in short pulses (latency), and every client connection of a primary
  cut (``CLIENT KILL``).

From a seed, one fault after another for ``--minutes``: ``kill -9`` of a node (a
supervisor starts it again on its ports), ``SIGSTOP`` of a node, the Redis faults
above, DynamoDB errors and throttling. Meanwhile stream-aware clients
(:class:`ChaosClient`, a :class:`~loadtest.clients.sim.SimClient` that records
every frame) watch games and reconnect with ``since`` whenever they are dropped, and
a publisher posts game events (some with an exclude-list, half with an
``Idempotency-Key`` and retried, half without and never retried) to random nodes.

Then the faults stop, the publisher stops, and :func:`check` compares what each
client got, stream by stream, with what the publisher was told (every 202 carries
the event's positions):

- **lost**: an accepted event at a position the client passed, neither received nor
  covered by a ``recovered: false`` that told it to refetch;
- **duplicated**: an event received twice (one publish at two offsets, or twice at
  one);
- **out of order**: an offset below one already received in the same epoch;
- **unannounced gaps**: offsets jumped over, or a new epoch started, without a
  ``recovered: false`` first;
- **conflicts**: two different events at one position;
- **presence**: seconds from the end of the last fault until every client's view
  equals the truth (every user online), at most 10 s;
- each ``recovered: false`` by cause: a new epoch (Redis lost its data), a hole past
  the history's size, or neither (not allowed).

It prints the seed, each fault with its time, and every count with examples.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import re
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.clients.sim import ClientSpec, LostCallback, SimClient, StreamBook, Tally
from loadtest.harness.faults import DynamoFaultProxy, TcpFaultProxy
from loadtest.harness.redis_cluster import RedisCluster, redis_cli, start_redis_cluster
from loadtest.harness.servers import (
    HOST,
    Proc,
    Secrets,
    StartError,
    create_table,
    start_moto,
    start_ours,
    start_redis,
)
from loadtest.harness.worker import mint_token

META = "chaos"
HISTORY_SIZE = 50
"""The nodes' ``--history-size``: a hole wider than this is truly gone from history."""
PRESENCE_GOAL_S = 10.0
"""The issue's goal: every tab's presence equals the truth this soon after the last fault."""
NODE_ARGS = [
    "--node-heartbeat-ms",
    "500",
    "--node-timeout-ms",
    "3000",
    "--history-size",
    str(HISTORY_SIZE),
]
_EID = re.compile(rb'"eid":"([^"\\]*)"')


@dataclass
class ChaosOptions:
    minutes: float = 10.0
    seed: int = 1
    topology: str = "redis"
    clients: int = 300
    games: int = 100
    games_per_client: int = 3
    rate: float = 40.0
    user_share: float = 0.3
    """Share of the events addressed to users (1 to 3 of them) instead of a game:
    quiet streams, often held only through a recovery."""
    nodes: int = 3
    exclude_share: float = 0.1
    settle: float = 30.0
    """Most seconds after the faults for presence and the last events to arrive."""


# --------------------------------------------------------------------------- truth


@dataclass
class Truth:
    """What the publisher was told."""

    accepted: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)
    """eid -> stream -> (epoch, offset), from each 202."""
    accepted_ns: dict[str, int] = field(default_factory=dict)
    """eid -> when the attempt that got its 202 was sent (``time.time_ns``, the
    clock of the clients' logs): the event was appended after that."""
    unknown: set[str] = field(default_factory=set)
    """Sent, never answered 202: maybe appended, maybe not."""
    unpositioned: set[str] = field(default_factory=set)
    """Answered 202 without positions: Redis was away, only that node's clients heard it."""
    excluded: dict[str, str] = field(default_factory=dict)
    attempts: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    repeats_moved: int = 0
    """A retry's 202 naming another position than an earlier 202 of the same key."""

    def at(self) -> dict[tuple[str, str, int], str]:
        return {
            (stream, epoch, offset): eid
            for eid, positions in self.accepted.items()
            for stream, (epoch, offset) in positions.items()
        }


# ------------------------------------------------------------------------- clients


class ChaosClient(SimClient):
    """A stream-aware client that also records every position and announcement."""

    def __init__(self, *args: Any, log: list[tuple[Any, ...]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = log
        self.frames = 0
        self.heads: list[bytes] = []
        """The first frames of this connection, for a report on a tab that stalls."""

    def _message(self, data: bytes, now: int) -> None:
        self.frames += 1
        if len(self.heads) < 3:
            self.heads.append(data[:80])
        super()._message(data, now)

    def _stream_message(self, data: bytes, now: int) -> bool:
        """Every positioned frame (game and user events, skips) and every answer."""
        if b'"offset":' not in data:
            return False
        try:
            message = json.loads(data)
        except ValueError:
            return False
        verb = message.get("verb")
        if verb == "recovered":
            self._recovered(data, now)
            return True
        stream, epoch, offset = message.get("stream"), message.get("epoch"), message.get("offset")
        if not isinstance(stream, str) or not isinstance(offset, int):
            return False
        payload = message.get("payload")
        eid = payload.get("eid") if isinstance(payload, dict) else None
        if verb == "skip":
            self.tally.skips += 1
        else:
            self.tally.game_events += 1
        self._advance(stream, str(epoch), offset)
        self.log.append(("e", stream, str(epoch), offset, eid, now))
        return True

    def _recovered(self, data: bytes, now: int) -> None:
        super()._recovered(data, now)
        payload = json.loads(data)["payload"]
        self.log.append(
            (
                "r",
                payload["stream"],
                payload["epoch"],
                int(payload["offset"]),
                bool(payload["recovered"]),
                now,
            )
        )


class ChaosBook(StreamBook):
    """A tab's positions, and every stream it holds: one it has no position for
    yet is named in ``since`` with the empty epoch, so that an event published
    while the tab was away, before it ever heard the stream, is answered too."""

    __slots__ = ("streams",)

    def __init__(self, streams: Sequence[str]) -> None:
        super().__init__()
        self.streams = tuple(streams)

    def since(self) -> dict[str, dict[str, Any]]:
        known = super().since()
        return {s: known.get(s, {"epoch": "", "offset": 0}) for s in self.streams}


@dataclass
class Seat:
    """One simulated tab, across its reconnects."""

    spec: ClientSpec
    token: str
    book: ChaosBook
    log: list[tuple[Any, ...]] = field(default_factory=list)
    client: ChaosClient | None = None
    reconnects: int = 0


# --------------------------------------------------------------------------- world


class World:
    """The processes, proxies and faults of one run."""

    def __init__(self, options: ChaosOptions, rng: random.Random) -> None:
        self.options = options
        self.rng = rng
        self.secrets = Secrets.generate()
        self.table = f"chaos-{uuid.uuid4().hex[:8]}"
        self.nodes: list[Proc] = []
        self.stopped: set[str] = set()
        self.dead: set[str] = set()
        self.moto: Proc | None = None
        self.dynamo: DynamoFaultProxy | None = None
        self.redis: Proc | None = None
        self.redis_port = 0
        self.proxy: TcpFaultProxy | None = None
        self.cluster: RedisCluster | None = None
        self.faults: list[dict[str, Any]] = []
        self.started = time.monotonic()
        self.crashed: list[str] = []
        """Nodes found dead that no fault killed."""
        self.redis_restarts = 0
        self.start_refusals = 0

    def t(self) -> float:
        return round(time.monotonic() - self.started, 2)

    async def start(self) -> None:
        self.moto, endpoint = await start_moto()
        await create_table(endpoint, self.table)
        self.dynamo = DynamoFaultProxy(endpoint)
        await self.dynamo.start()
        if self.options.topology == "cluster":
            self.cluster = await asyncio.to_thread(start_redis_cluster)
            url = self.cluster.url
        else:
            self.redis, direct = await start_redis()
            self.redis_port = int(direct.rsplit(":", 1)[1].split("/")[0])
            self.proxy = TcpFaultProxy(self.redis_port)
            await self.proxy.start()
            url = self.proxy.url
        self.redis_url = url
        self.nodes = list(
            await asyncio.gather(
                *(self._start_node(f"c{i + 1}") for i in range(self.options.nodes))
            )
        )
        self.started = time.monotonic()

    async def _start_node(self, name: str, ports: tuple[int, int] | None = None) -> Proc:
        for _ in range(5):
            try:
                return await self._start_node_once(name, ports)
            except StartError as exc:
                # A free port taken before the node bound it (a Redis Cluster's
                # outgoing connections use the same range): again, on fresh ports.
                if "address already in use" not in str(exc):
                    raise
                ports = None
        return await self._start_node_once(name, None)

    async def _start_node_once(self, name: str, ports: tuple[int, int] | None) -> Proc:
        assert self.dynamo is not None
        return await start_ours(
            name,
            self.secrets,
            debounce_ms=300,
            extra_args=NODE_ARGS,
            cluster=(self.redis_url, self.dynamo.endpoint, self.table),
            ports=ports,
            limit=90.0,
        )

    async def _restart_node(self, node: Proc) -> Proc:
        """As a supervisor would: again until it starts. A node refuses to start
        while DynamoDB refuses it (by design: a wrong endpoint fails fast)."""
        for attempt in range(30):
            try:
                return await self._start_node(node.name, (node.ws_port, node.http_port))
            except StartError as exc:
                self.start_refusals += 1
                if attempt == 29:
                    raise
                first_line = str(exc).splitlines()[-1][:160]
                self.faults.append({"t": self.t(), "kind": "start-refused", "why": first_line})
                await asyncio.sleep(1.0)
        raise AssertionError("unreachable")

    async def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(ProcessLookupError):
                if node.name in self.stopped:
                    os.kill(node.pid, signal.SIGCONT)
            node.stop(grace=3.0)
        if self.proxy is not None:
            await self.proxy.stop()
        if self.redis is not None:
            self.redis.stop()
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)
        if self.dynamo is not None:
            await self.dynamo.stop()
        if self.moto is not None:
            self.moto.stop()

    def live_nodes(self) -> list[Proc]:
        return [n for n in self.nodes if n.name not in self.dead and n.name not in self.stopped]

    def check_crashes(self) -> None:
        for node in self.nodes:
            if node.name not in self.dead and not node.running() and node.name not in self.crashed:
                self.crashed.append(node.name)
                self.faults.append({"t": self.t(), "kind": "CRASH", "target": node.name})

    # --- faults -------------------------------------------------------------

    def kinds(self) -> list[str]:
        """The faults of the main track; DynamoDB's run on a track of their own."""
        common = ["node-kill", "node-stop", "node-kill", "node-stop"]
        if self.options.topology == "cluster":
            return [
                *common,
                "primary-kill",
                "primary-freeze",
                "primary-latency",
                "primary-cut",
                "primary-cut",
            ]
        return [
            *common,
            "redis-latency",
            "redis-blackhole",
            "redis-cut",
            "redis-flaky",
            "redis-restart",
        ]

    async def fault(self, kind: str, rng: random.Random) -> None:
        record: dict[str, Any] = {"t": self.t(), "kind": kind}
        self.faults.append(record)
        if kind == "node-kill":
            node = rng.choice(self.nodes)
            record["target"] = node.name
            self.dead.add(node.name)
            node.process.send_signal(signal.SIGKILL)
            node.process.wait()
            await asyncio.sleep(rng.uniform(1.0, 4.0))
            index = self.nodes.index(node)
            self.nodes[index] = await self._restart_node(node)
            self.dead.discard(node.name)
        elif kind == "node-stop":
            node = rng.choice(self.nodes)
            record["target"] = node.name
            pause = rng.uniform(1.0, 6.0)
            record["seconds"] = round(pause, 2)
            self.stopped.add(node.name)
            os.kill(node.pid, signal.SIGSTOP)
            await asyncio.sleep(pause)
            os.kill(node.pid, signal.SIGCONT)
            self.stopped.discard(node.name)
        elif kind in ("dynamo-errors", "dynamo-throttle"):
            assert self.dynamo is not None
            seconds = rng.uniform(3.0, 10.0)
            record["seconds"] = round(seconds, 2)
            share = rng.uniform(0.2, 0.6)
            record["share"] = round(share, 2)
            if kind == "dynamo-errors":
                self.dynamo.randomize(random.Random(rng.random()), errors=share, throttles=0.0)
            else:
                self.dynamo.randomize(
                    random.Random(rng.random()), errors=0.0, throttles=share, latency=0.2
                )
            await asyncio.sleep(seconds)
            self.dynamo.recover()
        elif kind == "redis-latency":
            assert self.proxy is not None
            seconds, latency = rng.uniform(2.0, 8.0), rng.uniform(0.05, 0.5)
            record.update(seconds=round(seconds, 2), latency=round(latency, 3))
            self.proxy.latency = latency
            await asyncio.sleep(seconds)
            self.proxy.latency = 0.0
        elif kind == "redis-blackhole":
            assert self.proxy is not None
            # Past the clients' 5 s socket timeout too: they resend what is held.
            seconds = rng.uniform(1.0, 12.0)
            record["seconds"] = round(seconds, 2)
            self.proxy.blackhole()
            await asyncio.sleep(seconds)
            self.proxy.heal()
        elif kind == "redis-cut":
            assert self.proxy is not None
            record["connections"] = self.proxy.cut()
        elif kind == "redis-flaky":
            # A slow path and connections cut on it: replies in flight are lost
            # after their commands ran.
            assert self.proxy is not None
            seconds, latency = rng.uniform(2.0, 6.0), rng.uniform(0.02, 0.2)
            record.update(seconds=round(seconds, 2), latency=round(latency, 3))
            self.proxy.latency = latency
            cuts = 0
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                await asyncio.sleep(rng.uniform(0.3, 1.0))
                cuts += self.proxy.cut()
            record["connections"] = cuts
            self.proxy.latency = 0.0
        elif kind == "redis-restart":
            assert self.redis is not None
            self.redis.process.send_signal(signal.SIGKILL)
            self.redis.process.wait()
            down = rng.uniform(0.5, 3.0)
            record["seconds"] = round(down, 2)
            await asyncio.sleep(down)
            self.redis, _ = await start_redis(port=self.redis_port)
            self.redis_restarts += 1
        elif kind.startswith("primary-"):
            await self._cluster_fault(kind, record, rng)
        record["end"] = self.t()

    async def _cluster_fault(self, kind: str, record: dict[str, Any], rng: random.Random) -> None:
        cluster = self.cluster
        assert cluster is not None
        await asyncio.to_thread(cluster.wait_ok, 60.0)
        port = rng.choice(await asyncio.to_thread(cluster.primaries))
        record["target"] = port
        instance = cluster.instance(port)
        assert instance.process is not None
        if kind == "primary-kill":
            slots = await asyncio.to_thread(_slot_of, cluster, port)
            instance.kill()
            await asyncio.to_thread(cluster.wait_failover, port, slots, 30.0)
            await asyncio.to_thread(instance.start)  # back as a replica
            await asyncio.to_thread(cluster.wait_ok, 60.0)
        elif kind == "primary-freeze":
            # Under the cluster's node timeout (1 s): nothing answers, nothing fails over.
            seconds = rng.uniform(0.3, 0.8)
            record["seconds"] = round(seconds, 2)
            os.kill(instance.process.pid, signal.SIGSTOP)
            await asyncio.sleep(seconds)
            os.kill(instance.process.pid, signal.SIGCONT)
        elif kind == "primary-latency":
            seconds = rng.uniform(2.0, 6.0)
            record["seconds"] = round(seconds, 2)
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                os.kill(instance.process.pid, signal.SIGSTOP)
                await asyncio.sleep(0.05)
                os.kill(instance.process.pid, signal.SIGCONT)
                await asyncio.sleep(0.15)
        elif kind == "primary-cut":
            for kind_of in ("normal", "pubsub"):
                await asyncio.to_thread(redis_cli, port, "client", "kill", "type", kind_of)

    def heal(self) -> None:
        for node in self.nodes:
            if node.name in self.stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.pid, signal.SIGCONT)
        self.stopped.clear()
        if self.proxy is not None:
            self.proxy.heal()
        if self.dynamo is not None:
            self.dynamo.recover()


def _returning(client: ChaosClient) -> Callable[[], ChaosClient]:
    return lambda: client


def _slot_of(cluster: RedisCluster, port: int) -> int:
    for slot in range(0, 16384, 64):
        if cluster.owner(slot) == port:
            return slot
    raise StartError(f"primary {port} serves no slot")


# ------------------------------------------------------------------------ the run


class Soak:
    def __init__(self, options: ChaosOptions) -> None:
        self.options = options
        self.rng = random.Random(options.seed)
        self.world = World(options, random.Random(self.rng.random()))
        self.truth = Truth()
        self.seats: list[Seat] = []
        self.watchers: dict[str, list[str]] = {}
        self.users: list[str] = []
        self.closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self.tally = Tally()
        self.last_fault_end = 0.0
        self.main_fault_end = 0.0
        self.main_done = asyncio.Event()
        self.dump: Path | None = None
        """Where to write the logs of the clients that appear in examples."""

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- clients ------------------------------------------------------------

    def make_seats(self) -> None:
        rng = random.Random(self.rng.random())
        games = [f"g{i}" for i in range(self.options.games)]
        for i in range(self.options.clients):
            user = f"u{i}"
            watched = tuple(
                (META, g) for g in rng.sample(games, min(self.options.games_per_client, len(games)))
            )
            for _, game in watched:
                self.watchers.setdefault(game, []).append(user)
            spec = ClientSpec(user_id=user, games=watched, streams=True, full=True)
            streams = [f"game:{meta}#{game}" for meta, game in watched] + [f"user:{user}"]
            self.seats.append(
                Seat(spec, mint_token(self.world.secrets.jwt, user), ChaosBook(streams))
            )
            self.users.append(user)

    async def connect(self, seat: Seat, first: bool = False) -> None:
        loop = asyncio.get_running_loop()
        delay = 0.05 if first else random.uniform(0.2, 1.0)
        while not self.closing:
            await asyncio.sleep(delay)
            nodes = self.world.live_nodes() or self.world.nodes
            node = random.choice(nodes)
            client = ChaosClient(
                seat.spec,
                seat.token,
                HOST,
                node.ws_port,
                self.tally,
                on_lost=self._on_lost(seat),
                book=seat.book,
                log=seat.log,
            )
            try:
                await asyncio.wait_for(
                    loop.create_connection(_returning(client), HOST, node.ws_port), 5.0
                )
                await asyncio.wait_for(asyncio.shield(client.opened), 5.0)
            except (OSError, TimeoutError, Exception):
                client.abort()
                delay = min(2.0, delay * 2 + 0.1)
                continue
            if not client.is_open:
                # Lost between its open and now: _lost did not know it as the seat's.
                continue
            seat.client = client
            seat.log.append(("c", "", node.name, 0, None, time.time_ns()))
            return

    def _on_lost(self, seat: Seat) -> LostCallback:
        return lambda client, code: self._lost(seat, client)

    def _lost(self, seat: Seat, client: SimClient) -> None:
        if self.closing or seat.client is not client:
            return
        seat.client = None
        seat.reconnects += 1
        self._spawn(self.connect(seat))

    # --- publisher ----------------------------------------------------------

    async def publish_loop(self, until: float) -> None:
        import aiohttp

        rng = random.Random(self.rng.random())
        headers = {"Authorization": f"Bearer {self.world.secrets.publish}"}
        timeout = aiohttp.ClientTimeout(total=10.0)
        in_flight: set[asyncio.Task[None]] = set()
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            n = 0
            interval = 1.0 / self.options.rate
            next_at = time.monotonic()
            while time.monotonic() < until:
                next_at += interval
                eid = f"e{n}"
                body: dict[str, Any]
                watchers: list[str] = []
                if rng.random() < self.options.user_share:
                    users = rng.sample(self.users, rng.randint(1, 3))
                    body = {"verb": "yourTurn", "users": users, "payload": {"eid": eid}}
                else:
                    game = f"g{rng.randrange(self.options.games)}"
                    body = {"verb": "game", "payload": {"meta": META, "id": game, "eid": eid}}
                    watchers = self.watchers.get(game, [])
                if watchers and rng.random() < self.options.exclude_share:
                    excluded = rng.choice(watchers)
                    body["exclude"] = [excluded]
                    self.truth.excluded[eid] = excluded
                keyed = n % 2 == 0
                if len(in_flight) < 400:
                    task = asyncio.create_task(self._post(session, eid, body, keyed))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                n += 1
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if in_flight:
                await asyncio.wait(in_flight, timeout=30.0)

    async def _post(self, session: Any, eid: str, body: dict[str, Any], keyed: bool) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json"}
        if keyed:
            headers["Idempotency-Key"] = eid
        attempts = 4 if keyed else 1
        truth = self.truth
        for attempt in range(attempts):
            nodes = self.world.live_nodes() or self.world.nodes
            node = random.choice(nodes)
            truth.attempts += 1
            sent_ns = time.time_ns()
            try:
                async with session.post(
                    f"http://{HOST}:{node.http_port}/publish", data=data, headers=headers
                ) as response:
                    status = response.status
                    reply = await response.json(content_type=None) if status == 202 else None
            except Exception as exc:
                truth.answers[type(exc).__name__] += 1
                status, reply = 0, None
            else:
                truth.answers[str(status)] += 1
            if status == 202 and isinstance(reply, dict):
                positions = {
                    stream: (p["epoch"], int(p["offset"]))
                    for stream, p in reply.get("positions", {}).items()
                }
                if positions:
                    earlier = truth.accepted.get(eid)
                    if earlier is not None and earlier != positions:
                        truth.repeats_moved += 1
                    truth.accepted[eid] = positions
                    truth.accepted_ns.setdefault(eid, sent_ns)
                    truth.unknown.discard(eid)
                else:
                    truth.unpositioned.add(eid)  # Redis away: one node's clients only
                return
            truth.unknown.add(eid)
            if attempt + 1 < attempts:
                await asyncio.sleep(0.5 * (attempt + 1))

    # --- faults -------------------------------------------------------------

    async def fault_loop(self, until: float) -> None:
        """Node and Redis faults one after another; DynamoDB's meanwhile, on their
        own track, so that they meet the writes the other faults cause."""
        world = self.world

        async def track(
            kinds: list[str], pause: tuple[float, float], seed: float, main: bool
        ) -> None:
            # Each track its own generator: the schedule follows from the seed alone.
            rng = random.Random(seed)
            while time.monotonic() < until:
                await asyncio.sleep(rng.uniform(*pause))
                if time.monotonic() >= until:
                    break
                world.check_crashes()
                await world.fault(rng.choice(kinds), rng)
                self.last_fault_end = max(self.last_fault_end, time.monotonic())
                if main:
                    self.main_fault_end = time.monotonic()
                world.check_crashes()
            if main:
                self.main_done.set()

        seeds = (self.rng.random(), self.rng.random())
        await asyncio.gather(
            track(world.kinds(), (2.0, 6.0), seeds[0], True),
            track(["dynamo-errors", "dynamo-throttle"], (3.0, 10.0), seeds[1], False),
        )

    # --- presence -----------------------------------------------------------

    async def presence_converged(self, within: float) -> float | None:
        """Seconds after the last node or Redis fault until every tab sees every
        user, or None (DynamoDB's track may still be at work meanwhile)."""
        await self.main_done.wait()
        everyone = {seat.spec.user_id for seat in self.seats}
        deadline = self.main_fault_end + within
        while True:
            now = time.monotonic()
            if all(
                seat.client is not None
                and seat.client.is_open
                and seat.client.visible == everyone
                and seat.client.total == len(everyone)
                for seat in self.seats
            ):
                return round(now - self.main_fault_end, 2)
            if now > deadline:
                return None
            await asyncio.sleep(0.1)

    def presence_misses(self) -> list[str]:
        everyone = {seat.spec.user_id for seat in self.seats}
        misses = []
        for seat in self.seats:
            client = seat.client
            if client is None or not client.is_open:
                misses.append(f"{seat.spec.user_id}: not connected")
            elif client.total == 0:
                misses.append(
                    f"{seat.spec.user_id}: open on port {client.port} "
                    f"({seat.reconnects} reconnects), {client.frames} frames: {client.heads}"
                )
            elif client.visible != everyone or client.total != len(everyone):
                missing = sorted(everyone - client.visible)[:5]
                extra = sorted(client.visible - everyone)[:5]
                misses.append(
                    f"{seat.spec.user_id}: total {client.total}, missing {missing}, extra {extra}"
                )
        return misses

    # --- the whole run ------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        options = self.options
        world = self.world
        await world.start()
        try:
            self.make_seats()
            await asyncio.gather(*(self.connect(seat, first=True) for seat in self.seats))
            start = time.monotonic()
            world.started = start
            self.last_fault_end = self.main_fault_end = start
            until = start + options.minutes * 60.0
            publisher = asyncio.create_task(self.publish_loop(until + 5.0))
            presence = asyncio.create_task(self.presence_converged(options.settle))
            await self.fault_loop(until)
            world.heal()
            world.check_crashes()
            converged = await presence
            misses = [] if converged is not None else self.presence_misses()
            await publisher
            await self.drain(options.settle)
            world.check_crashes()
        finally:
            self.closing = True
            for seat in self.seats:
                if seat.client is not None:
                    seat.client.abort()
            for task in list(self._tasks):
                task.cancel()
            await world.stop()
        counts = check(self.seats, self.truth)
        if self.dump is not None:
            flagged = {
                line.split(" ", 1)[0] for lines in counts["examples"].values() for line in lines
            }
            logs = {s.spec.user_id: s.log for s in self.seats if s.spec.user_id in flagged}
            self.dump.write_text(json.dumps({"faults": world.faults, "logs": logs}, default=str))
        return {
            "seed": options.seed,
            "topology": options.topology,
            "minutes": options.minutes,
            "clients": options.clients,
            "rate": options.rate,
            "faults": world.faults,
            "fault_counts": dict(Counter(f["kind"] for f in world.faults)),
            "crashed": world.crashed,
            "start_refusals": world.start_refusals,
            "publishes": {
                "events": len(
                    self.truth.accepted.keys() | self.truth.unknown | self.truth.unpositioned
                ),
                "accepted": len(self.truth.accepted),
                "unknown": len(self.truth.unknown - self.truth.accepted.keys()),
                "unpositioned": len(self.truth.unpositioned),
                "attempts": self.truth.attempts,
                "answers": dict(self.truth.answers),
                "retry_moved_position": self.truth.repeats_moved,
            },
            "dynamodb_injected": dict(world.dynamo.injected) if world.dynamo else {},
            "reconnects": sum(seat.reconnects for seat in self.seats),
            "presence_converged_s": converged,
            "presence_misses": sorted(misses, key=lambda m: "frames" not in m)[:10],
            **counts,
        }

    async def drain(self, within: float) -> None:
        """Until every tab holds the top of every accepted event's stream, or ``within``."""
        top: dict[str, tuple[str, int]] = {}
        for positions in self.truth.accepted.values():
            for stream, (epoch, offset) in positions.items():
                if stream not in top or top[stream][1] < offset:
                    top[stream] = (epoch, offset)
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            behind = 0
            for seat in self.seats:
                streams = [f"game:{meta}#{game}" for meta, game in seat.spec.games]
                for stream in [*streams, f"user:{seat.spec.user_id}"]:
                    want = top.get(stream)
                    have = seat.book.positions.get(stream)
                    if want is not None and (have is None or list(want) != have[:2]):
                        behind += 1
            if not behind:
                return
            await asyncio.sleep(0.2)


# ------------------------------------------------------------------------ checker


@dataclass
class Findings:
    lost: int = 0
    duplicated: int = 0
    out_of_order: int = 0
    unannounced_gaps: int = 0
    conflicts: int = 0
    not_recovered: Counter[str] = field(default_factory=Counter)
    received: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)

    def example(self, kind: str, text: str) -> None:
        bucket = self.examples.setdefault(kind, [])
        if len(bucket) < 5:
            bucket.append(text)


def check(seats: Sequence[Seat], truth: Truth) -> dict[str, Any]:
    """Count, per client and stream, what went wrong (module docstring)."""
    findings = Findings()
    at = truth.at()
    by_stream: dict[str, dict[str, list[tuple[int, str]]]] = {}
    for eid, positions in truth.accepted.items():
        for stream, (epoch, offset) in positions.items():
            by_stream.setdefault(stream, {}).setdefault(epoch, []).append((offset, eid))
    for seat in seats:
        user = seat.spec.user_id
        per_stream: dict[str, list[tuple[Any, ...]]] = {}
        node = ""
        for entry in seat.log:
            if entry[0] == "c":  # a new connection, and to which node
                node = entry[2]
                continue
            per_stream.setdefault(entry[1], []).append((*entry, node))
        for stream, entries in per_stream.items():
            _check_stream(
                findings, user, stream, entries, at, by_stream.get(stream, {}), truth.accepted_ns
            )
    return {
        "lost": findings.lost,
        "duplicated": findings.duplicated,
        "out_of_order": findings.out_of_order,
        "unannounced_gaps": findings.unannounced_gaps,
        "conflicts": findings.conflicts,
        "received": findings.received,
        "recovered_false": dict(findings.not_recovered),
        "examples": findings.examples,
    }


def _check_stream(
    findings: Findings,
    user: str,
    stream: str,
    entries: list[tuple[Any, ...]],
    at: dict[tuple[str, str, int], str],
    truth_epochs: dict[str, list[tuple[int, str]]],
    accepted_ns: dict[str, int],
) -> None:
    where = f"{user} {stream}"
    seen_eids: dict[str, tuple[str, int]] = {}
    held: dict[tuple[str, int], str | None] = {}
    covered: dict[str, list[tuple[int, int]]] = {}  # epoch -> [(from, to)] told to refetch
    spans: dict[str, list[int]] = {}  # epoch -> [lowest, highest] position passed
    current: tuple[str, int] | None = None
    last_node = ""
    for entry in entries:
        if entry[0] == "r":
            _, _, epoch, top, recovered, _, node = entry
            if recovered:
                if current is None or current[0] != epoch or current[1] < top:
                    current = (epoch, top)
                continue
            if current is None:
                cause = "first-contact"
            elif current[0] != epoch:
                cause = "new-epoch"
            elif top - current[1] > HISTORY_SIZE:
                cause = "past-history"
            else:
                cause = "unexplained"
                findings.example(
                    "recovered_false_unexplained",
                    f"{where}: at {current} told recovered:false {epoch}:{top}",
                )
            findings.not_recovered[cause] += 1
            low = current[1] + 1 if current is not None and current[0] == epoch else 1
            covered.setdefault(epoch, []).append((low, top))
            span = spans.setdefault(epoch, [top, top])
            span[1] = max(span[1], top)
            current = (epoch, top)
            continue
        _, _, epoch, offset, eid, at_ns, node = entry
        findings.received += 1
        if eid is None:  # a skip: the event excluded for this user
            eid = at.get((stream, epoch, offset))
        key = (epoch, offset)
        if key in held and held[key] is not None and eid is not None and held[key] != eid:
            findings.conflicts += 1
            findings.example("conflicts", f"{where}: {epoch}:{offset} was {held[key]}, now {eid}")
        if eid is not None and eid in seen_eids:
            findings.duplicated += 1
            findings.example(
                "duplicated", f"{where}: {eid} at {seen_eids[eid]} and again at {epoch}:{offset}"
            )
        elif (
            current is not None and current[0] == epoch and offset <= current[1] and key not in held
        ):
            findings.out_of_order += 1
            findings.example("out_of_order", f"{where}: {eid} at {epoch}:{offset} after {current}")
        held.setdefault(key, eid)
        if eid is not None:
            seen_eids.setdefault(eid, key)
        if current is not None:
            if current[0] != epoch:
                findings.unannounced_gaps += 1
                findings.example(
                    "unannounced_gaps", f"{where}: from {current} to {epoch}:{offset}, no notice"
                )
            elif offset > current[1] + 1:
                findings.unannounced_gaps += 1
                findings.example(
                    "unannounced_gaps",
                    f"{where}: {current[1] + 1}..{offset - 1} of {epoch} jumped over, no notice "
                    f"(at {at_ns / 1e9:.3f} from {node}, the one before from {last_node})",
                )
        span = spans.setdefault(epoch, [offset, offset])
        span[0], span[1] = min(span[0], offset), max(span[1], offset)
        if current is None or current[0] != epoch or offset > current[1]:
            current = key
        last_node = node
    # Lost: accepted events inside what the client passed, neither held nor covered.
    for epoch, (low, high) in spans.items():
        for offset, eid in truth_epochs.get(epoch, []):
            if offset < low or offset > high or (epoch, offset) in held:
                continue
            if any(a <= offset <= b for a, b in covered.get(epoch, [])):
                continue
            findings.lost += 1
            findings.example("lost", f"{where}: {eid} at {epoch}:{offset} never arrived")
    # And past the last position: the stream went on without this client.
    if current is not None:
        epoch, offset = current
        beyond = [(o, e) for o, e in truth_epochs.get(epoch, []) if o > offset]
        for o, eid in beyond:
            findings.lost += 1
            findings.example("lost", f"{where}: {eid} at {epoch}:{o}, after the last one held")
        # An epoch never seen at all (between two Redis restarts): covered by any
        # recovered:false that came after its event was accepted.
        notices = [entry[5] for entry in entries if entry[0] == "r" and not entry[4]]
        for ep in (ep for ep in truth_epochs if ep not in spans):
            for o, eid in truth_epochs[ep]:
                if any(t > accepted_ns.get(eid, 0) for t in notices):
                    continue
                findings.lost += 1
                findings.example("lost", f"{where}: {eid} at {ep}:{o}, an epoch never seen")


# --------------------------------------------------------------------------- report

GOALS = ("lost", "duplicated", "out_of_order", "unannounced_gaps", "conflicts")


def passed(result: dict[str, Any], presence_goal_s: float | None = PRESENCE_GOAL_S) -> bool:
    """Every goal met; ``presence_goal_s=None`` asks only that presence converged
    (a verdict free of how much CPU the machine gave the nodes, for the test suite)."""
    converged = result["presence_converged_s"]
    return (
        all(result[name] == 0 for name in GOALS)
        and converged is not None
        and (presence_goal_s is None or converged <= presence_goal_s)
        and not result["crashed"]
        and not result["recovered_false"].get("unexplained")
    )


def report_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        f"chaos: seed {result['seed']}, topology {result['topology']}, "
        f"{result['minutes']} min, {result['clients']} clients, {result['rate']} events/s",
        "faults:",
    ]
    for fault in result["faults"]:
        extra = {k: v for k, v in fault.items() if k not in ("t", "kind")}
        lines.append(f"  {fault['t']:8.2f}s  {fault['kind']:<16} {json.dumps(extra)}")
    lines.append(f"fault counts: {json.dumps(result['fault_counts'], sort_keys=True)}")
    lines.append(f"publishes: {json.dumps(result['publishes'], sort_keys=True)}")
    lines.append(f"DynamoDB injected: {json.dumps(result['dynamodb_injected'], sort_keys=True)}")
    lines.append(
        f"client reconnects: {result['reconnects']}, positions received: {result['received']}"
    )
    for name in GOALS:
        lines.append(f"{name}: {result[name]}")
    lines.append(
        f"recovered:false by cause: {json.dumps(result['recovered_false'], sort_keys=True)}"
    )
    converged = result["presence_converged_s"]
    lines.append(
        "presence: "
        + (
            f"equal to the truth {converged} s after the last node or Redis fault"
            f" (goal {PRESENCE_GOAL_S:g} s)"
            if converged is not None
            else "NOT converged: " + "; ".join(result["presence_misses"])
        )
    )
    lines.append(f"nodes that died on their own: {result['crashed'] or 'none'}")
    lines.append(f"node starts refused (DynamoDB refusing at start): {result['start_refusals']}")
    for kind, examples in result["examples"].items():
        lines.append(f"examples of {kind}:")
        lines.extend(f"  {example}" for example in examples)
    lines.append("PASS" if passed(result) else "FAIL")
    return lines


async def run_chaos(options: ChaosOptions, dump: Path | None = None) -> dict[str, Any]:
    soak = Soak(options)
    soak.dump = dump
    return await soak.run()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest chaos", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--topology", choices=("redis", "cluster", "both"), default="both")
    parser.add_argument("--clients", type=int, default=300)
    parser.add_argument("--rate", type=float, default=40.0, help="events published per second")
    parser.add_argument("--games", type=int, default=30)
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    parser.add_argument(
        "--dump", type=Path, metavar="FILE", help="write the frames of the clients in examples"
    )
    args = parser.parse_args(argv)
    topologies = ("redis", "cluster") if args.topology == "both" else (args.topology,)
    results = []
    ok = True
    for topology in topologies:
        options = ChaosOptions(
            minutes=args.minutes,
            seed=args.seed,
            topology=topology,
            clients=args.clients,
            rate=args.rate,
            games=args.games,
        )
        started = os.getloadavg()
        begun = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        dump = args.dump.with_suffix(f".{topology}.json") if args.dump else None
        result = asyncio.run(run_chaos(options, dump))
        result["load_average"] = {"start": started, "end": os.getloadavg()}
        # what loadtest/report/table.py shows beside the figures
        result["date"] = begun
        result["command"] = ["python", "-m", "loadtest", "chaos", *argv]
        results.append(result)
        print("\n".join(report_lines(result)))
        print(f"load average: start {started}, end {result['load_average']['end']}", flush=True)
        ok = ok and passed(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
