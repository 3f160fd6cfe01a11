"""The ``bridge`` scenario: today's broadcast queue, through the queue bridge, to sockets.

Two cluster nodes run ``--sqs-queue-url`` on one moto SQS queue (competing
consumers) with one Redis and one table. ``W`` watchers, half on each node,
watch ``W / 2`` games, so every game has one watcher on each node. A sender
process puts ``R`` messages a second into the queue with ``SendMessageBatch``
(10 per call), today's body: ``{"verb":"game","payload":{meta,id,ts,k},"exclude":[]}``
where ``ts`` is the send time (ns) and ``k`` the event's number. Above 500 msg/s the
rate is split over several sender processes, so the driver's own CPU is not the limit.

- **steady**: both nodes live. Queue -> socket latency per delivery; lost and
  duplicated per (watcher, event).
- **backlog**: the same messages, each sent with a delay so that all become visible
  together a few seconds after the last is sent, as after an outage: every receive
  is a full batch of 10, so the nodes' CPU per message is the bridge's at full
  batches (its latency is the delay, not a figure).
- **kill**: the same as steady, and one node is killed with SIGKILL halfway through. What it
  had received and not deleted comes back after the visibility timeout and the
  other node publishes it. Lost and duplicated are counted on the survivor's
  watchers (the killed node's clients are gone with it).

Client processes use the ``websockets`` client and record ``(k, receive ns)`` per
frame, so every event is accounted for exactly. CPU of moto, Redis, each node and
the sender is read per phase, to show where the time goes:

- moto is not under test and runs off the nodes' CPUs (with the generator), so
  that it neither starves the nodes nor is starved by them;
- once the nodes are done with start-up work (the watchers' lastSeen and
  connection rows, thousands of moto calls), an **idle** phase measures their CPU
  with every watcher connected and nothing sent (pings, heartbeats, empty long
  polls); a phase's node CPU minus that idle rate, per message, is the bridge
  path's own cost, and its inverse the messages a node CPU-second takes;
- the queue's depth (visible, in flight and delayed) is sampled every second: moto's cost per
  call grows with it (``loadtest/METHODS.md``, "bridge").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import resource
import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtest.harness.runner import Run
from loadtest.harness.servers import (
    FAKE_AWS,
    Proc,
    create_table,
    start_moto,
    start_ours,
    start_redis,
)
from loadtest.report.targets import Target, check

Result = dict[str, Any]
Conn = multiprocessing.connection.Connection

VISIBILITY_SECONDS = 5
"""The nodes' ``--sqs-visibility-seconds``: how long a killed node's messages stay hidden."""


@dataclass(frozen=True)
class Watcher:
    user: str
    node: int
    game: int


# --- client processes ---------------------------------------------------------------


def _client_main(conn: Conn, secret: str, watchers: list[tuple[str, str, int]]) -> None:
    """A process holding ``watchers`` (user, ws url, game): records (k, received ns)."""
    import uvloop

    uvloop.run(_clients(conn, secret, watchers))


async def _clients(conn: Conn, secret: str, watchers: list[tuple[str, str, int]]) -> None:
    import jwt
    from websockets.asyncio.client import connect

    got: list[list[tuple[int, int, int]]] = [[] for _ in watchers]
    opened = settled = 0
    all_settled = asyncio.Event()

    def settle() -> None:
        nonlocal settled
        settled += 1
        if settled == len(watchers):
            all_settled.set()

    async def one(index: int, user: str, url: str, game: int) -> None:
        nonlocal opened
        counted = False
        token = jwt.encode(
            {"sub": user, "iat": int(time.time()), "exp": int(time.time()) + 86400},
            secret,
            algorithm="HS256",
        )
        try:
            async with connect(url, compression=None, open_timeout=30, max_queue=None) as ws:
                games = [{"meta": "bridge", "id": f"g{game}"}]
                await ws.send(
                    json.dumps(
                        {
                            "action": "subscribe",
                            "token": token,
                            "watchVersion": 1,
                            "wantsPresence": False,
                            "games": games,
                        }
                    )
                )
                await ws.send(json.dumps({"action": "watchGames", "games": games}))
                opened += 1
                counted = True
                settle()
                record = got[index].append
                async for raw in ws:
                    now = time.time_ns()
                    if '"verb":"game"' not in raw:
                        continue
                    frame = json.loads(raw)
                    payload = frame["payload"]
                    record((payload["k"], now - payload["ts"], frame.get("offset", 0)))
        except Exception:
            if not counted:  # never opened: the parent must not wait for it
                settle()

    loop = asyncio.get_running_loop()
    tasks = []
    for index, (user, url, game) in enumerate(watchers):
        tasks.append(asyncio.create_task(one(index, user, url, game)))
        if index % 50 == 49:
            await asyncio.sleep(0.02)
    await all_settled.wait()
    conn.send(("ready", opened))
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command == "collect":
            conn.send(("data", got))
            for kept in got:  # in place: each client appends to its own list object
                kept.clear()
        elif command == "stop":
            break
    for task in tasks:
        task.cancel()


# --- the sender process ---------------------------------------------------------------


def _sender_main(
    conn: Conn,
    endpoint: str,
    queue_url: str,
    games: int,
    rate: float,
    duration: float,
    first: int,
    visible_at_ns: int,
) -> None:
    import uvloop

    uvloop.run(_send(conn, endpoint, queue_url, games, rate, duration, first, visible_at_ns))


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _send(
    conn: Conn,
    endpoint: str,
    queue_url: str,
    games: int,
    rate: float,
    duration: float,
    first: int,
    visible_at_ns: int = 0,
) -> None:
    """Send at ``rate``; with ``visible_at_ns``, each message delayed until about then."""
    import aioboto3
    from botocore.config import Config

    total = max(1, int(rate * duration))
    pick = random.Random(first).randrange
    plan = [pick(games) for _ in range(total)]
    batches: asyncio.Queue[list[tuple[int, int]] | None] = asyncio.Queue()
    sent, failed, late = 0, 0, 0
    sent_keys: list[int] = []
    call_ms: list[float] = []
    send_ns: list[int] = []  # per sent key: how long SendMessageBatch took to accept it
    # Whatever is not sent by then is dropped unsent (and not expected): a queue that
    # cannot take the rate shows as a low send rate, not as a run that never ends.
    hard_end_ns = time.time_ns() + int((duration * 2 + 10) * 1e9)
    config = Config(max_pool_connections=32, retries={"mode": "standard", "max_attempts": 5})
    session = aioboto3.Session()
    async with session.client(
        "sqs", endpoint_url=endpoint, region_name="us-east-1", config=config
    ) as sqs:
        # Credentials, endpoint and first connections are set up before the clock starts.
        await asyncio.gather(*(sqs.get_queue_attributes(QueueUrl=queue_url) for _ in range(24)))

        async def sender() -> None:
            nonlocal sent, failed, late
            while True:
                batch = await batches.get()
                if batch is None:
                    return
                stamp = time.time_ns()
                if stamp > hard_end_ns:
                    continue
                if stamp - batch[0][1] > 50_000_000:
                    late += len(batch)
                entries = []
                for i, (k, _scheduled) in enumerate(batch):
                    ts = stamp  # queue -> socket: from the moment it is sent to the queue
                    payload = {"meta": "bridge", "id": f"g{plan[k - first]}", "ts": ts, "k": k}
                    body = {"verb": "game", "payload": payload, "exclude": []}
                    entry: dict[str, Any] = {"Id": str(i), "MessageBody": json.dumps(body)}
                    if visible_at_ns:
                        delay = math.ceil((visible_at_ns - stamp) / 1e9)
                        entry["DelaySeconds"] = max(0, min(900, delay))
                    entries.append(entry)
                try:
                    response = await sqs.send_message_batch(QueueUrl=queue_url, Entries=entries)
                except Exception:
                    failed += len(entries)
                    continue
                took_ns = time.time_ns() - stamp
                call_ms.append(took_ns / 1e6)
                refused = {int(entry["Id"]) for entry in response.get("Failed", [])}
                failed += len(refused)
                for i, (k, _) in enumerate(batch):
                    if i not in refused:
                        sent += 1
                        sent_keys.append(k)
                        send_ns.append(took_ns)

        workers = [asyncio.create_task(sender()) for _ in range(24)]
        cpu_before = _own_cpu()
        start_ns = time.time_ns()
        scheduled = 0
        pending: list[tuple[int, int]] = []
        while scheduled < total:
            now = time.time_ns()
            due = min(total, int((now - start_ns) * rate / 1e9) + 1)
            while scheduled < due:
                pending.append((first + scheduled, start_ns + int(scheduled * 1e9 / rate)))
                scheduled += 1
                if len(pending) == 10:
                    batches.put_nowait(pending)
                    pending = []
            # A batch is sent full, or once its oldest message waited 5 ms (as a
            # backend with steady traffic would not batch across seconds).
            if pending and now - pending[0][1] > 5_000_000:
                batches.put_nowait(pending)
                pending = []
            await asyncio.sleep(0.002)
        if pending:
            batches.put_nowait(pending)
        for _ in workers:
            batches.put_nowait(None)
        await asyncio.gather(*workers)
        ended = time.time_ns()
        cpu_used = _own_cpu() - cpu_before
    conn.send(
        {
            "first": first,
            "plan": plan,
            "sent_keys": sent_keys,
            "send_ns": send_ns,
            "call_ms": call_ms,
            "sent": sent,
            "failed": failed,
            "late": late,
            "wall_s": (ended - start_ns) / 1e9,
            "cpu_s": cpu_used,
        }
    )


SENDER_RATE = 500.0
"""Messages/s one sender process is given at most. aioboto3 costs about 2 ms of CPU
per SendMessageBatch (signing, serializing, parsing), whatever it holds; batches
fill only at high rates, so a higher rate is split over several processes rather
than capped by the driver's own CPU."""


async def _send_from_processes(
    endpoint: str,
    queue_url: str,
    games: int,
    rate: float,
    duration: float,
    first: int,
    visible_at_ns: int = 0,
) -> Result:
    """Run ``ceil(rate / SENDER_RATE)`` sender processes, each a share of the rate and a
    range of event numbers of its own; their figures merged."""
    count = max(1, math.ceil(rate / SENDER_RATE))
    started = []
    for index in range(count):
        parent, child = _ctx().Pipe()
        start = first + index * 1_000_000
        process = _ctx().Process(
            target=_sender_main,
            args=(child, endpoint, queue_url, games, rate / count, duration, start, visible_at_ns),
        )
        process.start()
        started.append((parent, process))
    results = [await _recv(parent, duration * 2 + 60) for parent, _ in started]
    for _, process in started:
        process.join(timeout=10)
    game_of: dict[int, int] = {}
    for result in results:
        base = result["first"]
        game_of.update((base + i, game) for i, game in enumerate(result["plan"]))
    calls = sorted(c for result in results for c in result["call_ms"]) or [math.nan]
    return {
        "senders": count,
        "game_of": game_of,
        "sent_keys": [k for result in results for k in result["sent_keys"]],
        "send_ns_of": {
            k: ns
            for result in results
            for k, ns in zip(result["sent_keys"], result["send_ns"], strict=True)
        },
        "send_call_ms": {
            "p50": round(calls[len(calls) // 2], 2),
            "p99": round(calls[int(len(calls) * 0.99)], 2),
        },
        "sent": sum(result["sent"] for result in results),
        "failed": sum(result["failed"] for result in results),
        "late": sum(result["late"] for result in results),
        "wall_s": max(result["wall_s"] for result in results),
        "cpu_s": sum(result["cpu_s"] for result in results),
    }


# --- the scenario ----------------------------------------------------------------------


def _ctx() -> Any:
    return multiprocessing.get_context("spawn")


async def _recv(conn: Conn, limit: float) -> Any:
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, conn.poll, limit):
        raise TimeoutError("a loadtest process did not answer")
    return conn.recv()


async def bridge(run: Run) -> Result:
    options = run.options
    for name, value in FAKE_AWS.items():  # moto takes any; the sender process inherits them
        os.environ.setdefault(name, value)
    rate = options.rate if options.rate is not None else 2000.0
    watchers_count = max(2, options.connections - options.connections % 2)
    games = watchers_count // 2
    run.progress.log("starting redis-server and moto_server")
    redis_proc, redis_url = await start_redis()
    run.track(redis_proc)
    moto_proc, endpoint = await start_moto()
    # moto stands in for SQS and DynamoDB and is not under test: on the nodes' CPU it
    # starves them and itself (one Python thread answers it all), so it runs on the
    # generator's CPUs.
    run.procs.append(moto_proc)
    if run.generator_cpus:
        os.sched_setaffinity(moto_proc.pid, run.generator_cpus)
    table = f"loadtest-{uuid.uuid4().hex[:8]}"
    await create_table(endpoint, table)
    queue_url = await _create_queue(endpoint)
    # Moto alone first, with no consumer: how much of the rate can the queue take here?
    moto_alone = await _moto_alone(run, endpoint, rate, min(5.0, options.duration))
    nodes: list[Proc] = []
    for index in range(2):
        run.progress.log(f"starting bridge node-{index + 1}")
        node = await start_ours(
            f"node-{index + 1}",
            run.secrets,
            debounce_ms=options.debounce_ms,
            extra_args=[
                "--sqs-queue-url",
                queue_url,
                "--sqs-endpoint",
                endpoint,
                "--sqs-visibility-seconds",
                str(VISIBILITY_SECONDS),
                "--sqs-wait-seconds",
                "2",
                *options.server_args,
            ],
            cluster=(redis_url, endpoint, table),
        )
        nodes.append(run.track(node))
    run.add_server("cluster", nodes)
    run.add_server("redis", [redis_proc])
    run.add_server("moto", [moto_proc])
    watchers = [Watcher(f"w{i}", i % 2, i // 2) for i in range(watchers_count)]
    clients = await _start_clients(run, nodes, watchers)
    try:
        settled_s = await _settle(run)
        idle = await _idle(run, nodes, redis_proc, min(10.0, max(1.0, options.duration / 2)))
        idle["settled_after_s"] = settled_s
        phases: dict[str, Result] = {}
        first = 0
        for phase in ("steady", "backlog", "kill"):
            seconds = min(5.0, options.duration / 4) if phase == "backlog" else options.duration
            run.progress.log(f"bridge {phase}: {rate:g} msg/s for {seconds:g} s")
            phases[phase] = await _phase(
                run,
                phase,
                endpoint,
                queue_url,
                nodes,
                moto_proc,
                redis_proc,
                clients,
                watchers,
                games,
                rate,
                first,
            )
            first += 10_000_000
        for result in phases.values():
            _add_marginal_cpu(result, idle, nodes)
    finally:
        for conn, process in clients:
            with contextlib.suppress(Exception):
                conn.send("stop")
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        await run.stop_servers("cluster", "redis", "moto")
    steady, backlog, kill = phases["steady"], phases["backlog"], phases["kill"]

    def note(phase: Result) -> str:
        rate_note = (
            f"sent {phase['send_rate']:g} of {phase['rate_asked']:g} msg/s asked"
            if phase["send_rate"] < 0.95 * phase["rate_asked"]
            else ""
        )
        drain_note = "" if phase["drained"] else f"queue not drained: {phase['queue_left']} left"
        return "; ".join(n for n in (rate_note, drain_note) if n)

    lost_ok = Target("bridge", "lost events", "", "<=", 0)
    dup_ok = Target("bridge", "duplicated events", "", "<=", 0)
    targets = [
        check(
            Target("bridge", "queue -> socket p99 (both nodes live)", "ms", "<=", 250.0),
            steady["latency"]["p99_ms"],
            watchers_count,
            note(steady),
        ),
        check(lost_ok, steady["lost"], 0, note(steady)),
        check(dup_ok, steady["dup"], 0, note(steady)),
        check(lost_ok, backlog["lost"], 0, "; ".join(filter(None, ["backlog", note(backlog)]))),
        check(dup_ok, backlog["dup"], 0, "; ".join(filter(None, ["backlog", note(backlog)]))),
        check(lost_ok, kill["lost"], 0, "; ".join(filter(None, ["one node killed", note(kill)]))),
        check(dup_ok, kill["dup"], 0, "; ".join(filter(None, ["one node killed", note(kill)]))),
    ]
    return {
        "servers": {
            "bridge": {
                "watchers": watchers_count,
                "games": games,
                "moto_alone": moto_alone,
                "moto_cpus": sorted(run.generator_cpus),
                "idle": idle,
                **phases,
            }
        },
        "targets": targets,
    }


async def _moto_alone(run: Run, endpoint: str, rate: float, duration: float) -> Result:
    """The sender against a queue nobody reads: the queue's own capacity on this machine."""
    queue_url = await _create_queue(endpoint)
    run.progress.log(f"moto alone: {rate:g} msg/s for {duration:g} s into a queue nobody reads")
    sent = await _send_from_processes(endpoint, queue_url, 1, rate, duration, 0)
    return {
        "rate_asked": rate,
        "send_rate": round(sent["sent"] / max(1e-9, sent["wall_s"]), 1),
        "sent": sent["sent"],
        "send_call_ms": sent["send_call_ms"],
    }


def _add_marginal_cpu(phase: Result, idle: Result, nodes: Sequence[Proc]) -> None:
    """The bridge path's own cost: the nodes' CPU above their idle rate, per message.

    A killed node's CPU is not in the phase's figures at all (it is read at the end),
    so only the live nodes' idle rate is taken off.
    """
    wall = phase["wall_s"]
    node_cpu = node_idle = 0.0
    for node in nodes:
        if node.name in phase["cpu_s"]:
            node_cpu += phase["cpu_s"][node.name]
            node_idle += idle["cpu_cores"].get(node.name, 0.0) * wall
    marginal = node_cpu - node_idle
    if marginal <= 0:  # lost in the noise of the idle rate: no figure
        phase["node_marginal_cpu_ms_per_message"] = math.nan
        phase["messages_per_node_cpu_second"] = math.nan
        return
    phase["node_marginal_cpu_ms_per_message"] = round(1000 * marginal / max(1, phase["sent"]), 3)
    phase["messages_per_node_cpu_second"] = round(phase["sent"] / marginal, 1)


SETTLED_NODE_CORES = 0.1
"""The nodes are done with start-up work (each subscriber's lastSeen write and
connection row, through moto) once together they use less than this."""


async def _settle(run: Run) -> float:
    """Wait until the nodes' start-up work is over; the seconds it took.

    Subscribing 2,000 watchers makes each node write their lastSeen and connection
    rows, thousands of moto calls that go on for seconds after the last subscribe.
    Measured in a phase, they would be charged to the bridge, and slow moto down.
    """
    waited = await run.settle("cluster", cores=SETTLED_NODE_CORES, quiet_seconds=2, limit=90.0)
    settled = round(waited, 1)
    run.progress.log(f"nodes settled after {settled:g} s")
    return settled


async def _idle(run: Run, nodes: Sequence[Proc], redis: Proc, seconds: float) -> Result:
    """The nodes' and Redis's CPU with every watcher connected and nothing sent."""
    run.progress.log(f"idle: {seconds:g} s with the watchers connected and nothing sent")
    procs = [*nodes, redis]
    before = {p.name: p.cpu() for p in procs}
    started = time.monotonic()
    await asyncio.sleep(seconds)
    wall = time.monotonic() - started
    return {
        "seconds": round(wall, 2),
        "cpu_cores": {p.name: round((p.cpu() - before[p.name]) / wall, 4) for p in procs},
    }


async def _create_queue(endpoint: str) -> str:
    import aioboto3

    session = aioboto3.Session()
    async with session.client("sqs", endpoint_url=endpoint, region_name="us-east-1") as sqs:
        response = await sqs.create_queue(
            QueueName=f"abstractplay-ws-messages-loadtest-{uuid.uuid4().hex[:8]}",
            Attributes={"VisibilityTimeout": "900", "MessageRetentionPeriod": "86400"},
        )
        return str(response["QueueUrl"])


async def _start_clients(
    run: Run, nodes: Sequence[Proc], watchers: Sequence[Watcher]
) -> list[tuple[Conn, Any]]:
    per_process = 1000
    ctx = _ctx()
    clients: list[tuple[Conn, Any]] = []
    for start in range(0, len(watchers), per_process):
        chunk = [
            (w.user, f"ws://127.0.0.1:{nodes[w.node].ws_port}/", w.game)
            for w in watchers[start : start + per_process]
        ]
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_client_main, args=(child, run.secrets.jwt, chunk))
        process.start()
        clients.append((parent, process))
    for conn, _ in clients:
        kind, _opened = await _recv(conn, 120)
        assert kind == "ready", kind
    run.progress.log(f"{len(watchers)} watchers subscribed")
    await asyncio.sleep(1.0)  # the watchGames repeats land, every node subscribed its games
    return clients


async def _phase(
    run: Run,
    phase: str,
    endpoint: str,
    queue_url: str,
    nodes: Sequence[Proc],
    moto: Proc,
    redis: Proc,
    clients: Sequence[tuple[Conn, Any]],
    watchers: Sequence[Watcher],
    games: int,
    rate: float,
    first: int,
) -> Result:
    duration = run.options.duration
    visible_at_ns = 0
    if phase == "backlog":
        # The messages become visible together a few seconds after the last is sent,
        # as after an outage: receives are full batches. A quarter of the phase (at
        # most 5 s) is enough: moto's cost per message grows with the backlog.
        duration = min(5.0, duration / 4)
        visible_at_ns = time.time_ns() + int((duration + 3) * 1e9)
    cpu_before = {p.name: p.cpu() for p in [*nodes, moto, redis] if p.running()}
    depths: list[int] = []
    sampler = asyncio.create_task(_sample_depth(endpoint, queue_url, depths))
    started = time.monotonic()
    sending = asyncio.create_task(
        _send_from_processes(endpoint, queue_url, games, rate, duration, first, visible_at_ns)
    )
    killed: int | None = None
    if phase == "kill":
        await asyncio.sleep(duration / 2)
        victim = nodes[0]
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(timeout=10)
        killed = 0
        run.progress.log(f"killed {victim.name} at {time.monotonic() - started:.1f} s")
    sent = await sending
    send_wall = time.monotonic() - started
    # Drain: everything sent must come through; a killed node's share after the timeout.
    drain_limit = VISIBILITY_SECONDS * 4 + (90 if phase == "backlog" else 30)
    queue_left = await _wait_drained(endpoint, queue_url, drain_limit)
    sampler.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sampler
    game_of: dict[int, int] = sent["game_of"]
    expected_by_game: dict[int, set[int]] = {}
    for k in sent["sent_keys"]:  # what SQS accepted; an unsent message is no one's loss
        expected_by_game.setdefault(game_of[k], set()).add(k)
    # A deleted message's event may still be on its way to the sockets (the bus, the
    # node's loop, the client's): on a loaded machine that takes any time, so collect
    # until every counted watcher holds every event, not after a fixed pause.
    received = await _collect_until_complete(
        clients,
        [
            expected_by_game.get(w.game, set()) if killed is None or w.node != killed else None
            for w in watchers
        ],
        limit=30.0,
    )
    wall = time.monotonic() - started
    cpu = {
        name: round(p.cpu() - cpu_before[name], 3)
        for p in [*nodes, moto, redis]
        if (name := p.name) in cpu_before and p.running()
    }
    lost = dup = 0
    latencies: list[int] = []
    after_accept: list[int] = []
    send_ns_of: dict[int, int] = sent["send_ns_of"]
    counted = 0
    dup_samples: list[dict[str, Any]] = []
    lost_samples: list[dict[str, Any]] = []
    for watcher, got in zip(watchers, received, strict=True):
        if killed is not None and watcher.node == killed:
            continue  # its socket died with the node
        counted += 1
        keys = [k for k, _, _ in got]
        unique = set(keys)
        expected = expected_by_game.get(watcher.game, set())
        missing = expected - unique
        lost += len(missing)
        if missing and len(lost_samples) < 10:
            lost_samples.append(
                {"watcher": watcher.user, "node": watcher.node, "k": sorted(missing)[:10]}
            )
        dup += len(keys) - len(unique)
        latencies += [ns for _, ns, _ in got]
        after_accept += [ns - send_ns_of.get(k, 0) for k, ns, _ in got]
        if len(keys) != len(unique) and len(dup_samples) < 10:
            # Same offset twice: delivered twice by a node; two offsets: published twice.
            offsets: dict[int, list[int]] = {}
            for k, _, offset in got:
                offsets.setdefault(k, []).append(offset)
            dup_samples += [
                {"watcher": watcher.user, "node": watcher.node, "k": k, "offsets": o}
                for k, o in offsets.items()
                if len(o) > 1
            ]
    values = np.asarray(latencies, dtype=np.float64) / 1e6 if latencies else np.asarray([math.nan])
    p50, p90, p99, p999 = (
        float(v) for v in np.percentile(values, [50, 90, 99, 99.9], method="higher")
    )
    # From SendMessageBatch's answer (the queue holds the message) to the socket:
    # the bridge's part, without the seconds moto takes to accept a batch.
    accepted = np.asarray(after_accept, dtype=np.float64) / 1e6 if after_accept else values
    a50, a99 = (float(v) for v in np.percentile(accepted, [50, 99], method="higher"))
    return {
        "rate_asked": rate,
        "sent": sent["sent"],
        "senders": sent["senders"],
        "send_failed": sent["failed"],
        "send_rate": round(sent["sent"] / max(1e-9, sent["wall_s"]), 1),
        "sent_late": sent["late"],
        "send_call_ms": sent["send_call_ms"],
        "watchers_counted": counted,
        "deliveries": len(latencies),
        # Sent, never delivered, and no longer in the queue: only then is it lost.
        # Messages still queued at the end are "not yet delivered" (a queue slower
        # than the rate), counted apart.
        "lost": max(0, lost - queue_left * (1 if killed is not None else 2)),
        "undelivered": lost,
        "queue_left": queue_left,
        "drained": queue_left == 0,
        "dup": dup,
        "node_cpu_ms_per_message": round(
            1000 * sum(v for k, v in cpu.items() if k.startswith("node")) / max(1, sent["sent"]),
            3,
        ),
        "moto_cpu_ms_per_message": round(1000 * cpu.get("moto", 0.0) / max(1, sent["sent"]), 3),
        "sender_cpu_ms_per_message": round(1000 * sent["cpu_s"] / max(1, sent["sent"]), 3),
        "queue_depth": {
            "mean": round(sum(depths) / len(depths), 1) if depths else math.nan,
            "max": max(depths, default=0),
        },
        "accepted_to_socket": {"p50_ms": round(a50, 2), "p99_ms": round(a99, 2)},
        "latency": {
            "p50_ms": round(p50, 2),
            "p90_ms": round(p90, 2),
            "p99_ms": round(p99, 2),
            "p999_ms": round(p999, 2),
            "max_ms": round(float(values.max()), 2),
        },
        "send_wall_s": round(send_wall, 2),
        "wall_s": round(wall, 2),
        "cpu_s": cpu,
        "cpu_cores": {name: round(value / wall, 3) for name, value in cpu.items()},
        "killed": nodes[killed].name if killed is not None else None,
        "duplicates_sample": dup_samples[:10],
        "lost_sample": lost_samples,
    }


async def _collect_until_complete(
    clients: Sequence[tuple[Conn, Any]],
    expected: Sequence[set[int] | None],
    limit: float,
) -> list[list[tuple[int, int, int]]]:
    """Every watcher's frames, collected until each has its ``expected`` keys.

    A watcher expecting None (its node was killed) is collected but not waited for.
    After ``limit`` seconds without a new frame, what has arrived is returned: the
    rest is lost.
    """
    received: list[list[tuple[int, int, int]]] = [[] for _ in expected]
    deadline = time.monotonic() + limit
    while True:
        batch: list[list[tuple[int, int, int]]] = []
        for conn, _ in clients:
            conn.send("collect")
        for conn, _ in clients:
            _kind, data = await _recv(conn, 60)
            batch += data
        for kept, more in zip(received, batch, strict=True):
            kept += more
        if any(batch):
            deadline = time.monotonic() + limit
        complete = all(
            keys is None or keys <= {k for k, _, _ in got}
            for got, keys in zip(received, expected, strict=True)
        )
        if complete or time.monotonic() >= deadline:
            return received
        await asyncio.sleep(0.5)


async def _sample_depth(endpoint: str, queue_url: str, depths: list[int]) -> None:
    """Every second, the queue's visible + in-flight + delayed messages (until cancelled)."""
    import aioboto3

    session = aioboto3.Session()
    async with session.client("sqs", endpoint_url=endpoint, region_name="us-east-1") as sqs:
        while True:
            with contextlib.suppress(Exception):
                depths.append(await _depth(sqs, queue_url))
            await asyncio.sleep(1.0)


async def _depth(sqs: Any, queue_url: str) -> int:
    attributes = (
        await sqs.get_queue_attributes(
            QueueUrl=queue_url,
            AttributeNames=[
                "ApproximateNumberOfMessages",
                "ApproximateNumberOfMessagesNotVisible",
                "ApproximateNumberOfMessagesDelayed",
            ],
        )
    )["Attributes"]
    return sum(int(v) for v in attributes.values())


async def _wait_drained(endpoint: str, queue_url: str, limit: float) -> int:
    """Wait until the queue is empty; return what is left in it when the time is up."""
    import aioboto3

    session = aioboto3.Session()
    deadline = time.monotonic() + limit
    async with session.client("sqs", endpoint_url=endpoint, region_name="us-east-1") as sqs:
        while time.monotonic() < deadline:
            left = await _depth(sqs, queue_url)
            if left == 0:
                return 0
            await asyncio.sleep(0.5)
    return left
