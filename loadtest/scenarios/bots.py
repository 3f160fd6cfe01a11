"""The ``bots`` scenario: bots on one node, their turns published through another,
and a restart of the bots' node in the middle.

- Two cluster nodes share a Redis and a DynamoDB table (moto). Every bot connects
  to the *bots' node* with an RS256 access token of a bot pool (JWKS from a file)
  and has a ``BOT`` row and ``CURRENTGAMES#`` rows written with boto3 in the real
  shapes: it is in ``--games-per-conn`` games and is to move in exactly one of
  them, so every ``pendingTurns`` must name that game and nothing else.
- A publisher posts ``yourTurn`` user events at ``--rate`` per second to the
  *other* node, round-robin over the bots and their games. Each payload carries
  its scheduled send time (latency without coordinated omission), its phase and
  a serial number.
- After ``--duration`` seconds of steady state the bots' node is stopped (SIGTERM:
  1012 to every bot) and started again on the same ports while publishing goes
  on. The bots reconnect with ``since`` for their user stream, as the guide says.
- Then publishing stops and every bot must hold every turn whose publish was
  accepted (202), live or replayed; a turn missing is ``missed``.

Bots run in this process on the ``websockets`` client: 500 sockets and a few
hundred frames per second are far below what one event loop handles.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import jwt
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from loadtest.harness.runner import Run
from loadtest.harness.servers import (
    FAKE_AWS,
    HOST,
    create_table,
    start_moto,
    start_redis,
)
from loadtest.report.stats import Histogram
from loadtest.report.targets import Target, check

Result = dict[str, Any]

BOT_ISSUER = "https://cognito-idp.loadtest.invalid/us-east-1_bots"
BOT_SCOPE = "loadtest-resource-server/communicate"
META = "loadtest"
KID = "loadtest-key"
OPPONENT = "loadtest-human"

TARGETS = {
    "p99": Target("bots", "p99 publish -> bot at steady state", "ms", "<=", 50.0, ("bots", 500)),
    "missed": Target("bots", "turns missed after the restart", "", "<=", 0),
}


@dataclass
class Bot:
    bot_id: str
    token: str
    games: list[str]
    to_move: str  # the one game whose row says this bot must move
    positions: dict[str, dict[str, Any]] = field(default_factory=dict)
    turns: set[int] = field(default_factory=set)
    subscribes: int = 0
    pending_frames: int = 0
    pending_wrong: int = 0
    duplicates: int = 0
    recovered: int = 0
    not_recovered: int = 0
    errors: list[str] = field(default_factory=list)
    release: Callable[[], None] | None = None  # frees the bot's place in the connect ramp


@dataclass
class Fleet:
    bots: list[Bot]
    latency: dict[str, Histogram] = field(default_factory=dict)
    accepted: dict[str, set[int]] = field(default_factory=dict)
    publish_failures: int = 0
    published: int = 0
    phase: str = "warmup"

    def trouble(self) -> str:
        """What went wrong so far, for a timeout's message."""
        errors = sorted({e for b in self.bots for e in b.errors})
        subscribes = sum(b.subscribes for b in self.bots)
        text = f"; {subscribes} subscribes sent"
        return text + (f"; errors: {errors[:5]}" if errors else "")

    def handle(self, bot: Bot, message: dict[str, Any]) -> None:
        received = time.time_ns()
        if "stream" in message and "offset" in message:
            bot.positions[message["stream"]] = {
                "epoch": message["epoch"],
                "offset": message["offset"],
            }
        verb, payload = message.get("verb"), message.get("payload") or {}
        if verb == "yourTurn":
            serial = payload["n"]
            if serial in bot.turns:
                bot.duplicates += 1
            bot.turns.add(serial)
            histogram = self.latency.setdefault(payload["ph"], Histogram())
            histogram.record(max(0, (received - payload["ts"]) // 1000))
        elif verb == "pendingTurns":
            bot.pending_frames += 1
            if bot.release is not None:
                bot.release()
                bot.release = None
            games = [(g["meta"], g["id"]) for g in payload["games"]]
            if games != [(META, bot.to_move)]:
                bot.pending_wrong += 1
        elif verb == "recovered":
            bot.positions[payload["stream"]] = {
                "epoch": payload["epoch"],
                "offset": payload["offset"],
            }
            if payload["recovered"]:
                bot.recovered += 1
            else:
                bot.not_recovered += 1
        elif verb == "error":
            bot.errors.append(f"{payload.get('code')}: {payload.get('message')}")


async def run_bot(
    fleet: Fleet, bot: Bot, url: str, stop: asyncio.Event, ramp: asyncio.Semaphore
) -> None:
    """Stay connected, as the guide's client does: resubscribe with ``since``.

    The first subscribe waits for a place in ``ramp``, held until its
    ``pendingTurns`` arrives; reconnects after the restart all come at once.
    """
    await ramp.acquire()
    bot.release = ramp.release
    try:
        while not stop.is_set():
            with contextlib.suppress(OSError, ConnectionClosed, InvalidHandshake, TimeoutError):
                async with connect(url, open_timeout=10, compression=None) as ws:
                    subscribe: dict[str, Any] = {
                        "action": "subscribe",
                        "token": bot.token,
                        "since": dict(bot.positions),  # as the guide says: even when empty
                    }
                    await ws.send(json.dumps(subscribe))
                    bot.subscribes += 1
                    async for data in ws:
                        fleet.handle(bot, json.loads(data))
            if not stop.is_set():
                await asyncio.sleep(0.2 + random.random() * 0.3)  # the node is restarting
    finally:
        if bot.release is not None:
            bot.release()
            bot.release = None


async def publish_turns(
    fleet: Fleet, url: str, secret: str, rate: float, stop: asyncio.Event, connections: int
) -> None:
    """``yourTurn`` at a fixed rate; ``ts`` is the scheduled time, so lag shows as latency."""
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=connections)
    tasks: set[asyncio.Task[None]] = set()
    bots = fleet.bots
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=10)
    ) as http:

        async def post(serial: int, bot: Bot, body: bytes) -> None:
            try:
                async with http.post(url, data=body, headers=headers) as response:
                    await response.read()
                    ok = response.status == 202
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                fleet.accepted.setdefault(bot.bot_id, set()).add(serial)
            else:
                fleet.publish_failures += 1

        start = time.monotonic()
        start_ns = time.time_ns()
        serial = 0
        while not stop.is_set():
            due = start + serial / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            bot = bots[serial % len(bots)]
            game = bot.games[(serial // len(bots)) % len(bot.games)]
            payload = {
                "meta": META,
                "id": game,
                "ts": start_ns + int(serial / rate * 1e9),
                "ph": fleet.phase,
                "n": serial,
            }
            body = json.dumps({"verb": "yourTurn", "users": [bot.bot_id], "payload": payload})
            task = asyncio.create_task(post(serial, bot, body.encode()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            fleet.published += 1
            serial += 1
        if tasks:
            await asyncio.wait(tasks, timeout=15)


# --- set-up -------------------------------------------------------------------


def _jwks_file(key: rsa.RSAPrivateKey, directory: Path) -> Path:
    entry = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    entry.update({"kid": KID, "alg": "RS256", "use": "sig"})
    path = directory / "bot-jwks.json"
    path.write_text(json.dumps({"keys": [entry]}))
    return path


def _token(key: rsa.RSAPrivateKey, bot_id: str, lifetime: int) -> str:
    now = int(time.time())
    claims = {
        "sub": bot_id,
        "client_id": bot_id,
        "iss": BOT_ISSUER,
        "token_use": "access",
        "scope": BOT_SCOPE,
        "iat": now,
        "exp": now + lifetime,
    }
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": KID})


def make_bots(count: int, games_per_bot: int, key: rsa.RSAPrivateKey, lifetime: int) -> list[Bot]:
    bots: list[Bot] = []
    for index in range(count):
        bot_id = f"loadtest-bot-{index}"
        games = [f"b{index}-g{g}" for g in range(max(1, games_per_bot))]
        bots.append(Bot(bot_id, _token(key, bot_id, lifetime), games, to_move=games[0]))
    return bots


def _dynamodb(endpoint: str) -> Any:
    return boto3.client(
        "dynamodb",
        endpoint_url=endpoint,
        region_name=FAKE_AWS["AWS_DEFAULT_REGION"],
        aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
    )


def _bot_item(bot_id: str) -> dict[str, Any]:
    """A ``BOT`` row as the backend's ``create_bot`` writes it."""
    return {
        "pk": {"S": "BOT"},
        "sk": {"S": bot_id},
        "name": {"S": bot_id},
        "owner": {"S": OPPONENT},
        "endpoint": {"S": "https://bot.invalid/hook"},
        "lastseen": {"N": str(int(time.time() * 1000))},
    }


def _batch_write(client: Any, table: str, items: list[dict[str, Any]]) -> int:
    for start in range(0, len(items), 25):
        requests = [{"PutRequest": {"Item": item}} for item in items[start : start + 25]]
        pending: dict[str, Any] = {table: requests}
        while pending:
            response = client.batch_write_item(RequestItems=pending)
            pending = response.get("UnprocessedItems") or {}
    return len(items)


def write_bot_rows(endpoint: str, table: str, bot_ids: Sequence[str]) -> int:
    """Only ``BOT`` rows: production keeps no ``CURRENTGAMES#`` rows for bots."""
    return _batch_write(_dynamodb(endpoint), table, [_bot_item(b) for b in bot_ids])


def write_rows(endpoint: str, table: str, bots: Sequence[Bot]) -> int:
    """``BOT`` and ``CURRENTGAMES#`` rows, as the backend writes them."""
    items: list[dict[str, Any]] = []
    for bot in bots:
        items.append(_bot_item(bot.bot_id))
        for game in bot.games:
            players = [(OPPONENT, "Opponent"), (bot.bot_id, bot.bot_id)]
            items.append(
                {
                    "pk": {"S": f"CURRENTGAMES#{bot.bot_id}"},
                    "sk": {"S": game},
                    "id": {"S": game},
                    "metaGame": {"S": META},
                    "players": {
                        "L": [
                            {"M": {"id": {"S": p}, "name": {"S": n}, "time": {"N": "86400000"}}}
                            for p, n in players
                        ]
                    },
                    "toMove": {"S": "1" if game == bot.to_move else "0"},
                    "clockHard": {"BOOL": False},
                    "lastMoveTime": {"N": str(int(time.time() * 1000))},
                    "numMoves": {"N": "2"},
                }
            )
    return _batch_write(_dynamodb(endpoint), table, items)


# --- the scenario -----------------------------------------------------------------


async def _wait(
    run: Run,
    label: str,
    done: Callable[[], int],
    total: int,
    limit: float,
    hint: Callable[[], str] = lambda: "",
) -> float:
    """Seconds until ``done()`` reaches ``total``; raises after ``limit`` with ``hint()``."""
    started = time.monotonic()
    while (count := done()) < total:
        if time.monotonic() - started > limit:
            raise RuntimeError(f"bots: {label}: {count}/{total} after {limit:.0f} s{hint()}")
        run.progress.update(label, count, total)
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def bots(run: Run) -> Result:
    options = run.options
    count = options.connections
    rate = options.rate or 200.0
    duration = options.duration
    workdir = Path(tempfile.mkdtemp(prefix="ap-loadtest-bots-"))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    fleet = Fleet(make_bots(count, options.games_per_conn, key, int(options.timeout) + 600))

    run.progress.log("starting redis-server and moto_server")
    redis_proc, redis_url = await start_redis()
    run.track(redis_proc)
    moto_proc, endpoint = await start_moto()
    # moto stands in for DynamoDB and is not under test: it may use any CPU (pinned
    # with the nodes it starves them, and itself: one Python thread answers it all).
    run.procs.append(moto_proc)
    table = f"loadtest-{uuid.uuid4().hex[:8]}"
    await create_table(endpoint, table)
    rows = await asyncio.to_thread(write_rows, endpoint, table, fleet.bots)
    run.progress.log(f"wrote {rows} BOT and CURRENTGAMES# rows")
    bot_args = [
        f"--bot-cognito-issuer={BOT_ISSUER}",
        f"--bot-scope={BOT_SCOPE}",
        f"--bot-jwks-file={_jwks_file(key, workdir)}",
        *options.server_args,
    ]
    cluster = (redis_url, endpoint, table)

    bots_node = await run.start_cluster_node("bots-node", cluster, bot_args)
    front = await run.start_cluster_node("front-node", cluster, bot_args)
    run.add_server("bots", [bots_node, front])
    url = f"ws://{HOST}:{bots_node.ws_port}/"
    publish_url = f"http://{HOST}:{front.http_port}/publish"

    stop_bots, stop_publishing = asyncio.Event(), asyncio.Event()
    # First connects go in waves, as bots come up over time; reconnects after the
    # restart all come at once (each bot retries every 0.2-0.5 s).
    ramp = asyncio.Semaphore(max(1, options.ramp // 2))
    clients = [asyncio.create_task(run_bot(fleet, bot, url, stop_bots, ramp)) for bot in fleet.bots]
    publisher: asyncio.Task[None] | None = None
    try:
        connect_s = await _wait(
            run,
            "bots subscribed (pendingTurns received)",
            lambda: sum(b.pending_frames >= 1 for b in fleet.bots),
            count,
            # each subscribe of a bot costs two moto requests (its BOT row and its
            # CURRENTGAMES# rows), and moto, one Python thread, answered only a few
            # dozen per second on the shared test machine
            options.connect_timeout + count * 0.6,
            fleet.trouble,
        )
        run.activate("bots", "steady")
        publisher = asyncio.create_task(
            publish_turns(fleet, publish_url, run.secrets.publish, rate, stop_publishing, 16)
        )
        await asyncio.sleep(options.warmup_seconds)
        fleet.phase = "steady"
        before = run.meter()
        published_before = fleet.published
        await asyncio.sleep(duration)
        after = run.meter()
        steady_rate = (fleet.published - published_before) / max(1e-9, after.wall - before.wall)
        steady_cpu = run.interval(before, after, "bots")

        fleet.phase = "restart"
        subscribes = [b.subscribes for b in fleet.bots]
        restart_at = time.monotonic()
        run.progress.log("restarting the bots' node (SIGTERM, then the same ports)")
        await asyncio.to_thread(bots_node.stop)
        down_s = time.monotonic() - restart_at
        bots_node = await run.start_cluster_node(
            "bots-node", cluster, bot_args, (bots_node.ws_port, bots_node.http_port)
        )
        run.add_server("bots", [bots_node, front])
        back_s = time.monotonic() - restart_at

        def resubscribed() -> int:
            return sum(
                b.subscribes > s and b.pending_frames >= 2
                for b, s in zip(fleet.bots, subscribes, strict=True)
            )

        with contextlib.suppress(RuntimeError):  # the figures say how many made it
            await _wait(
                run,
                "bots resubscribed after the restart",
                resubscribed,
                count,
                options.connect_timeout + count * 0.6,
                fleet.trouble,
            )
        resubscribed_s = time.monotonic() - restart_at
        fleet.phase = "after"
        await asyncio.sleep(max(1.0, duration / 2))
        stop_publishing.set()
        await publisher
        publisher = None

        def complete() -> int:
            return sum(fleet.accepted.get(b.bot_id, set()) <= b.turns for b in fleet.bots)

        with contextlib.suppress(RuntimeError):  # what is still missing is the figure
            await _wait(run, "bots holding every accepted turn", complete, count, 15.0)
    finally:
        stop_publishing.set()
        if publisher is not None:
            with contextlib.suppress(Exception):
                await publisher
        stop_bots.set()
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        shutil.rmtree(workdir, ignore_errors=True)

    missed = sum(len(fleet.accepted.get(b.bot_id, set()) - b.turns) for b in fleet.bots)
    accepted = sum(len(v) for v in fleet.accepted.values())
    steady = fleet.latency.get("steady", Histogram())
    replay = Histogram()
    for phase in ("restart", "after"):
        replay.merge(fleet.latency.get(phase, Histogram()))
    figures = {
        "bots": count,
        "games_per_bot": options.games_per_conn,
        "rate_per_s": rate,
        "steady_publish_rate": round(steady_rate, 1),
        "connect_s": round(connect_s, 2),
        "steady": {
            "latency": steady.summary_ms(),
            "server_cores": steady_cpu.get("server_cores"),
            "generator_cores": steady_cpu.get("generator_cores"),
            "generator_share": steady_cpu.get("generator_share"),
        },
        "restart": {
            "stop_s": round(down_s, 2),
            "back_ready_s": round(back_s, 2),
            "all_resubscribed_s": round(resubscribed_s, 2),
            "resubscribed": resubscribed(),
            "latency_incl_replay": replay.summary_ms(),
            "recovered_true": sum(b.recovered for b in fleet.bots),
            "recovered_false": sum(b.not_recovered for b in fleet.bots),
        },
        "published": fleet.published,
        "accepted": accepted,
        "publish_failures": fleet.publish_failures,
        "missed": missed,
        "duplicates": sum(b.duplicates for b in fleet.bots),
        "pending_turns_frames": sum(b.pending_frames for b in fleet.bots),
        "pending_turns_wrong": sum(b.pending_wrong for b in fleet.bots),
        "errors": sorted({e for b in fleet.bots for e in b.errors})[:10],
    }
    p99 = float(steady.percentile(0.99)) / 1000 if steady.count else float("nan")
    targets = [
        check(TARGETS["p99"], p99, count),
        # With nothing accepted, "0 missed" would prove nothing.
        check(
            TARGETS["missed"],
            missed if accepted else float("nan"),
            count,
            f"of {accepted} accepted turns",
        ),
    ]
    return {"servers": {"bots": figures}, "targets": targets}
