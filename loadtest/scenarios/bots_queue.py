"""``bots --bot-queue``: turns fed through today's bot outbound queue on a moto server.

- Two cluster nodes (one Redis, a moto table) both run ``--bot-queue-url`` on one moto
  SQS queue and forward to one FIFO ``--bot-webhook-queue-url``. Every bot has a
  ``BOT`` row and nothing else (production keeps no ``CURRENTGAMES#`` rows for bots),
  connects to the *bots' node* with a bot-pool access token and speaks streams
  (``since``), as the guide's client does.
- This process sends ``{"type":"move","metaGame","gameid","botId"}`` bodies with
  ``SendMessageBatch`` at ``--rate`` per second, round-robin over the bots; each
  game id names its serial, and the send time of each serial is kept (queue -> bot
  latency from just before the batch is sent to the frame's arrival).
- A drainer reads the forward queue, as the webhook Lambda would, and notes every
  serial it finds there.
- Phases: steady (``--duration`` s), then the bots' node is killed (SIGKILL) and
  started again on its ports, then half of the bots go away for ``--duration`` s
  (their messages must be forwarded) and come back with ``since``, then an after
  phase. Then sending stops, both queues drain, and every serial must have reached
  its bot exactly once counting WebSocket and forwarded together: ``missed`` had
  neither (a serial seen only in a ``pendingTurns`` list is counted apart, as
  ``pending_only``), ``duplicated`` had more than one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aioboto3
from cryptography.hazmat.primitives.asymmetric import rsa
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from loadtest.harness.runner import Run
from loadtest.harness.servers import (
    FAKE_AWS,
    HOST,
    Proc,
    create_table,
    start_moto,
    start_redis,
)
from loadtest.report.stats import Histogram
from loadtest.report.targets import Target, check
from loadtest.scenarios.abuse import run_metrics
from loadtest.scenarios.bots import (
    BOT_ISSUER,
    BOT_SCOPE,
    META,
    _jwks_file,
    _token,
    write_bot_rows,
)

Result = dict[str, Any]

SENDS_IN_FLIGHT = 2
BACK_OFF_ERRORS = {"too_many_connections", "unavailable"}
FINAL_WAIT_SECONDS = 240.0
"""After sending stops: how long every turn may take to arrive (moto on a loaded machine
answered some requests only after tens of seconds)."""
VISIBILITY_SECONDS = 20
"""The nodes' visibility timeout: a killed node's messages come back this much later
(and are delivered once its claims lapse, twice this); shorter, and moto's slow answers
under load let messages come back while they are being delivered."""

TARGETS = {
    "p99": Target(
        "bots-queue", "queue -> bot p99 (steady)", "ms", "<=", 250.0, ("bots-queue", 500)
    ),
    "missed": Target("bots-queue", "turns missed (WebSocket + forwarded)", "", "<=", 0),
    "duplicated": Target("bots-queue", "turns duplicated (WebSocket + forwarded)", "", "<=", 0),
}


@dataclass
class QueueBot:
    bot_id: str
    token: str
    positions: dict[str, dict[str, Any]] = field(default_factory=dict)
    away: bool = False
    back: asyncio.Event = field(default_factory=asyncio.Event)
    leave: asyncio.Event = field(default_factory=asyncio.Event)
    subscribes: int = 0
    pending_frames: int = 0
    recovered_false: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class Ledger:
    """Every serial: when it was sent, and each time it arrived, by which way."""

    sent_ns: dict[int, int] = field(default_factory=dict)
    phase_of: dict[int, str] = field(default_factory=dict)
    websocket: dict[int, int] = field(default_factory=dict)
    forwarded: dict[int, int] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    latency: dict[str, Histogram] = field(default_factory=dict)
    forward_latency: Histogram = field(default_factory=Histogram)
    phase: str = "warmup"
    send_failures: int = 0
    offsets: dict[int, list[int]] = field(default_factory=dict)
    """Each serial's stream offsets as it arrived over WebSocket: one offset twice is a
    delivery repeated, two offsets one message appended twice."""

    def arrived(self, serial: int, way: dict[int, int], received_ns: int) -> None:
        way[serial] = way.get(serial, 0) + 1
        sent = self.sent_ns.get(serial)
        if sent is None:
            return
        micros = max(0, (received_ns - sent) // 1000)
        if way is self.websocket:
            self.latency.setdefault(self.phase_of[serial], Histogram()).record(micros)
        else:
            self.forward_latency.record(micros)


def serial_of(game_id: str) -> int | None:
    head, _, tail = game_id.rpartition("-s")
    return int(tail) if head and tail.isdigit() else None


def on_frame(ledger: Ledger, bot: QueueBot, message: dict[str, Any]) -> None:
    received = time.time_ns()
    if "stream" in message and "offset" in message:
        bot.positions[message["stream"]] = {"epoch": message["epoch"], "offset": message["offset"]}
    verb, payload = message.get("verb"), message.get("payload") or {}
    if verb == "yourTurn":
        serial = serial_of(str(payload.get("id", "")))
        if serial is not None:
            ledger.arrived(serial, ledger.websocket, received)
            ledger.offsets.setdefault(serial, []).append(int(message.get("offset", -1)))
    elif verb == "pendingTurns":
        bot.pending_frames += 1
        for game in payload["games"]:
            serial = serial_of(str(game.get("id", "")))
            if serial is not None:
                ledger.pending.add(serial)
    elif verb == "recovered":
        bot.positions[payload["stream"]] = {"epoch": payload["epoch"], "offset": payload["offset"]}
        if not payload["recovered"]:
            bot.recovered_false += 1
    elif verb == "error":
        bot.errors.append(f"{payload.get('code')}: {payload.get('message')}")


async def run_queue_bot(ledger: Ledger, bot: QueueBot, url: str, stop: asyncio.Event) -> None:
    """Stay connected with ``since``; while ``away``, stay disconnected."""
    while not stop.is_set():
        if bot.away:
            await bot.back.wait()
            continue
        with contextlib.suppress(OSError, ConnectionClosed, InvalidHandshake, TimeoutError):
            async with connect(url, open_timeout=10, compression=None) as ws:
                # Its own stream named even before it has a position (epoch ""): what was
                # appended while it was away is then replayed from the stream's start.
                since = {f"user:{bot.bot_id}": {"epoch": "", "offset": 0}} | bot.positions
                subscribe = {"action": "subscribe", "token": bot.token, "since": since}
                await ws.send(json.dumps(subscribe))
                bot.subscribes += 1
                leaving = asyncio.create_task(bot.leave.wait())
                reading: asyncio.Task[Any] | None = None
                try:
                    while True:
                        reading = asyncio.create_task(ws.recv())
                        done, _ = await asyncio.wait(
                            {reading, leaving}, return_when=asyncio.FIRST_COMPLETED
                        )
                        if reading not in done:
                            break
                        on_frame(ledger, bot, json.loads(reading.result()))
                finally:
                    for task in (reading, leaving):
                        if task is not None:
                            task.cancel()
                            with contextlib.suppress(BaseException):
                                await task
        if not stop.is_set() and not bot.away:
            # As the guide's client: a node that said "later" (1013) or a bot over its
            # socket cap (4509, sockets the node has not seen close yet) waits 5 s or more.
            refused = bot.errors[-1:] and bot.errors[-1].split(":")[0] in BACK_OFF_ERRORS
            await asyncio.sleep(
                (5.0 if refused else 0.2) + random.random() * (5.0 if refused else 0.3)
            )
            if refused:
                bot.errors.append("(backed off)")


async def send_turns(
    ledger: Ledger, sqs: Any, queue_url: str, bots: list[QueueBot], rate: float, stop: asyncio.Event
) -> None:
    """Batches of 10 at ``rate`` messages/s, several in flight (moto answers one at a
    time, slowly); a failed batch is retried until it is in."""
    gate = asyncio.Semaphore(SENDS_IN_FLIGHT)
    tasks: set[asyncio.Task[None]] = set()

    async def send(first: int, entries: list[dict[str, str]]) -> None:
        async with gate:
            while True:
                stamp = time.time_ns()
                try:
                    response = await sqs.send_message_batch(QueueUrl=queue_url, Entries=entries)
                except Exception:
                    ledger.send_failures += 1
                    await asyncio.sleep(0.2)
                    continue
                if not response.get("Failed"):
                    break
                ledger.send_failures += 1
        for index in range(len(entries)):
            ledger.sent_ns[first + index] = stamp

    start = time.monotonic()
    serial = 0
    while not stop.is_set():
        due = start + serial / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        entries = []
        for index in range(10):
            bot = bots[(serial + index) % len(bots)]
            game = f"{bot.bot_id}-s{serial + index}"
            body = {"type": "move", "metaGame": META, "gameid": game, "botId": bot.bot_id}
            entries.append({"Id": str(index), "MessageBody": json.dumps(body)})
        for index in range(10):
            # Its phase is the one it was made in, even if its send is still out
            # when the phase ends: ``settle`` waits for it before the next phase.
            ledger.phase_of[serial + index] = ledger.phase
        task = asyncio.create_task(send(serial, entries))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        serial += 10
    if tasks:
        await asyncio.wait(tasks, timeout=30)


async def drain_forward(ledger: Ledger, sqs: Any, forward_url: str, stop: asyncio.Event) -> None:
    """What the webhook Lambda does: receive, note, delete."""
    while not stop.is_set():
        try:
            response = await sqs.receive_message(
                QueueUrl=forward_url, MaxNumberOfMessages=10, WaitTimeSeconds=1
            )
        except Exception:
            await asyncio.sleep(0.5)
            continue
        messages = response.get("Messages", [])
        received = time.time_ns()
        for message in messages:
            serial = serial_of(json.loads(message["Body"]).get("gameid", ""))
            if serial is not None:
                ledger.arrived(serial, ledger.forwarded, received)
        if messages:
            entries = [
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)
            ]
            with contextlib.suppress(Exception):
                await sqs.delete_message_batch(QueueUrl=forward_url, Entries=entries)


async def settle(ledger: Ledger, run: Run, label: str, limit: float = 60.0) -> None:
    """Until every serial made so far arrived one way or the other (or ``limit`` s),
    those whose send is still out included: a phase's last batch must not meet the
    next phase's kill."""
    sent = list(ledger.phase_of)
    started = time.monotonic()
    while time.monotonic() - started < limit:
        done = sum(1 for s in sent if s in ledger.websocket or s in ledger.forwarded)
        if done >= len(sent):
            return
        run.progress.update(label, done, len(sent))
        await asyncio.sleep(0.2)


async def queue_depth(sqs: Any, queue_url: str) -> int:
    attributes = (
        await sqs.get_queue_attributes(
            QueueUrl=queue_url,
            AttributeNames=[
                "ApproximateNumberOfMessages",
                "ApproximateNumberOfMessagesNotVisible",
            ],
        )
    )["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]) + int(
        attributes["ApproximateNumberOfMessagesNotVisible"]
    )


async def bridge_counters(nodes: list[Proc]) -> dict[str, float]:
    """The bot queue bridge's counters, summed over ``nodes``: where messages went."""
    totals: dict[str, float] = {}
    for proc in nodes:
        for name, value in (await run_metrics(proc)).items():
            if name.startswith("ap_bot_queue_") and not name.endswith(("_in_flight", "_seconds")):
                totals[name] = totals.get(name, 0.0) + value
    return totals


async def bots_queue(run: Run) -> Result:
    options = run.options
    count = options.connections
    rate = options.rate or 100.0
    duration = options.duration
    workdir = Path(tempfile.mkdtemp(prefix="ap-loadtest-botsq-"))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    lifetime = int(options.timeout) + 600
    bots = [QueueBot(f"qbot-{i}", _token(key, f"qbot-{i}", lifetime)) for i in range(count)]

    run.progress.log("starting redis-server and moto_server")
    redis_proc, redis_url = await start_redis()
    run.track(redis_proc)
    # Two moto servers, SQS on one and DynamoDB on the other: each answers on one
    # Python process, and SQS's receive costs more the deeper the queue.
    moto_proc, endpoint = await start_moto()
    run.procs.append(moto_proc)  # not under test
    sqs_proc, sqs_endpoint = await start_moto()
    run.procs.append(sqs_proc)
    # Measured, not pinned: their cores say whether moto is what limits the rate.
    run.add_server("moto-dynamodb", [moto_proc])
    run.add_server("moto-sqs", [sqs_proc])
    table = f"loadtest-{uuid.uuid4().hex[:8]}"
    await create_table(endpoint, table)
    await asyncio.to_thread(write_bot_rows, endpoint, table, [b.bot_id for b in bots])
    session = aioboto3.Session()
    ledger = Ledger()
    depths: list[int] = []
    async with session.client(
        "sqs",
        endpoint_url=sqs_endpoint,
        region_name=FAKE_AWS["AWS_DEFAULT_REGION"],
        aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
    ) as sqs:
        suffix = uuid.uuid4().hex[:8]
        queue_url = (
            await sqs.create_queue(
                QueueName=f"abstractplay-bot-outbound-{suffix}",
                Attributes={"VisibilityTimeout": "60"},
            )
        )["QueueUrl"]
        forward_url = (
            await sqs.create_queue(
                QueueName=f"abstractplay-bot-webhook-{suffix}.fifo",
                Attributes={"FifoQueue": "true", "VisibilityTimeout": "60"},
            )
        )["QueueUrl"]
        node_args = [
            f"--bot-cognito-issuer={BOT_ISSUER}",
            f"--bot-scope={BOT_SCOPE}",
            f"--bot-jwks-file={_jwks_file(key, workdir)}",
            f"--bot-queue-url={queue_url}",
            f"--bot-webhook-queue-url={forward_url}",
            f"--sqs-endpoint={sqs_endpoint}",
            "--sqs-wait-seconds=1",
            f"--sqs-visibility-seconds={VISIBILITY_SECONDS}",
            # Each receive walks moto's whole queue: two long polls per node are plenty
            # at the rates moto carries.
            "--sqs-pollers=2",
            *options.server_args,
        ]
        cluster = (redis_url, endpoint, table)

        bots_node = await run.start_cluster_node("bots-node", cluster, node_args)
        other = await run.start_cluster_node("queue-node", cluster, node_args)
        run.add_server("bots-queue", [bots_node, other])
        url = f"ws://{HOST}:{bots_node.ws_port}/"
        stop_bots, stop_sending, stop_draining = asyncio.Event(), asyncio.Event(), asyncio.Event()
        clients = [asyncio.create_task(run_queue_bot(ledger, b, url, stop_bots)) for b in bots]
        sender: asyncio.Task[None] | None = None
        drainer = asyncio.create_task(drain_forward(ledger, sqs, forward_url, stop_draining))

        async def sample() -> None:
            while True:
                with contextlib.suppress(Exception):
                    depths.append(await queue_depth(sqs, queue_url))
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample())
        timings: dict[str, float] = {}
        try:
            started = time.monotonic()
            while sum(b.pending_frames >= 1 for b in bots) < count:
                if time.monotonic() - started > options.connect_timeout + count * 0.6:
                    raise RuntimeError("bots --bot-queue: the bots did not all subscribe")
                subscribed = sum(b.pending_frames >= 1 for b in bots)
                run.progress.update("bots subscribed", subscribed, count)
                await asyncio.sleep(0.1)
            timings["connect_s"] = round(time.monotonic() - started, 2)
            run.activate("bots-queue", "steady")
            sender = asyncio.create_task(
                send_turns(ledger, sqs, queue_url, bots, rate, stop_sending)
            )
            await asyncio.sleep(options.warmup_seconds)
            ledger.phase = "steady"
            before, sent_before = run.meter(), len(ledger.sent_ns)
            await asyncio.sleep(duration)
            after = run.meter()
            steady_cpu = run.interval(before, after, "bots-queue")
            steady_cores = {
                label: run.interval(before, after, label).get("server_cores")
                for label in ("moto-sqs", "moto-dynamodb")
            }
            steady_cores["generator"] = steady_cpu.get("generator_cores")
            bridge = await bridge_counters([bots_node, other])
            timings["steady_send_rate"] = round(
                (len(ledger.sent_ns) - sent_before) / max(1e-9, after.wall - before.wall), 1
            )

            # The kill's redeliveries must not count against the steady phase.
            await settle(ledger, run, "steady turns delivered before the kill")
            ledger.phase = "kill"
            run.progress.log("kill -9 of the bots' node, then a start on the same ports")
            killed_at = time.monotonic()
            bots_node.process.kill()
            await asyncio.to_thread(bots_node.process.wait, 10)
            bots_node = await run.start_cluster_node(
                "bots-node", cluster, node_args, (bots_node.ws_port, bots_node.http_port)
            )
            run.add_server("bots-queue", [bots_node, other])
            timings["restarted_s"] = round(time.monotonic() - killed_at, 2)
            await asyncio.sleep(max(2.0, duration / 2))

            await settle(ledger, run, "turns delivered after the kill")
            ledger.phase = "away"
            away = bots[: count // 2]
            run.progress.log(f"{len(away)} bots away for {duration:g} s")
            for bot in away:
                bot.away = True
                bot.back.clear()
                bot.leave.set()
            await asyncio.sleep(duration)
            for bot in away:
                bot.away = False
                bot.leave.clear()
                bot.back.set()
            ledger.phase = "after"
            await asyncio.sleep(max(2.0, duration / 2))
            stop_sending.set()
            await sender
            sender = None
            sent = set(ledger.sent_ns)

            def accounted() -> int:
                return sum(1 for s in sent if s in ledger.websocket or s in ledger.forwarded)

            waited = time.monotonic()
            while accounted() < len(sent) and time.monotonic() - waited < FINAL_WAIT_SECONDS:
                run.progress.update("turns accounted for", accounted(), len(sent))
                await asyncio.sleep(0.2)
            timings["drain_after_stop_s"] = round(time.monotonic() - waited, 2)
            await asyncio.sleep(3.0)  # room for a repeat to show up
            timings["queue_left"] = await queue_depth(sqs, queue_url)
        finally:
            stop_sending.set()
            if sender is not None:
                sender.cancel()
                with contextlib.suppress(BaseException):
                    await sender
            stop_bots.set()
            for bot in bots:
                bot.back.set()
                bot.leave.set()
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            stop_draining.set()
            sampler.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(drainer, 5)
            shutil.rmtree(workdir, ignore_errors=True)

    sent = set(ledger.sent_ns)
    arrivals = {s: ledger.websocket.get(s, 0) + ledger.forwarded.get(s, 0) for s in sent}
    missing = {s for s, n in arrivals.items() if n == 0}
    serial_bot = {s: bots[s % len(bots)].bot_id for s in sent}
    missed_phases: dict[str, int] = {}
    for serial in missing - ledger.pending:
        phase = ledger.phase_of[serial]
        missed_phases[phase] = missed_phases.get(phase, 0) + 1
    pending_only = len(missing & ledger.pending)
    missed = len(missing) - pending_only
    repeated = sorted(s for s, n in arrivals.items() if n > 1)
    duplicated = len(repeated)
    duplicates_sample = [
        {
            "serial": s,
            "bot": serial_bot[s],
            "phase": ledger.phase_of[s],
            "offsets": ledger.offsets.get(s, []),
            "forwarded": ledger.forwarded.get(s, 0),
        }
        for s in repeated[:10]
    ]
    both_ways = sum(1 for s in sent if s in ledger.websocket and s in ledger.forwarded)
    steady = ledger.latency.get("steady", Histogram())
    every = Histogram()
    for histogram in ledger.latency.values():
        every.merge(histogram)
    by_phase: dict[str, dict[str, int]] = {}
    for serial in sent:
        counts = by_phase.setdefault(
            ledger.phase_of[serial], {"sent": 0, "websocket": 0, "forwarded": 0}
        )
        counts["sent"] += 1
        counts["websocket"] += serial in ledger.websocket
        counts["forwarded"] += serial in ledger.forwarded
    figures = {
        "bots": count,
        "rate_per_s": rate,
        **timings,
        "sent": len(sent),
        "websocket": sum(1 for s in sent if s in ledger.websocket),
        "forwarded": sum(1 for s in sent if s in ledger.forwarded),
        "missed": missed,
        "pending_only": pending_only,
        "missed_by_phase": missed_phases,
        "missed_bots": len({serial_bot[s] for s in missing - ledger.pending}),
        "bots_never_back": sum(1 for b in bots if b.pending_frames < 2),
        "duplicated": duplicated,
        "duplicates_sample": duplicates_sample,
        "both_ways": both_ways,
        "by_phase": by_phase,
        "steady": {
            "latency": steady.summary_ms(),
            "server_cores": steady_cpu.get("server_cores"),
            "other_cores": steady_cores,
            "bridge_counters": bridge,
        },
        "latency_all_websocket": every.summary_ms(),
        "latency_by_phase": {p: h.summary_ms() for p, h in ledger.latency.items()},
        "forward_latency": ledger.forward_latency.summary_ms(),
        "queue_depth_max": max(depths, default=0),
        "queue_depth_samples": depths[-5:],
        "send_failures": ledger.send_failures,
        "recovered_false": sum(b.recovered_false for b in bots),
        "errors": sorted({e for b in bots for e in b.errors if e != "(backed off)"})[:10],
        "backoffs": sum(b.errors.count("(backed off)") for b in bots),
    }
    p99 = float(steady.percentile(0.99)) / 1000 if steady.count else float("nan")
    targets = [
        check(TARGETS["p99"], p99, count),
        check(TARGETS["missed"], missed if sent else float("nan"), count, f"of {len(sent)} sent"),
        check(TARGETS["duplicated"], duplicated if sent else float("nan"), count),
    ]
    return {"servers": {"bots-queue": figures}, "targets": targets}
