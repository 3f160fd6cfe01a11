"""The ``chat`` scenario: comments on one game from two nodes, post -> ``chatAck``.

- Two cluster nodes share a Redis and a DynamoDB table (moto) holding the game's
  ``GAME`` row with every author as a player.
- ``--connections`` authors (default 4, the players of the game, half on each
  node) watch the game; a comment goes out every ``1 / --rate`` seconds (default
  20 a second), round-robin over the authors, so the two nodes contend for the
  game's lock all the time. Each node's ``--chat-rate`` and flood credits
  (``--flood-credits``: each author sends ``--rate / --connections`` frames a
  second, more than a browser tab's default allows) leave room for that, so the
  figure is chat's path, not the limits'.
  (Every comment also queues dashboard marks for each player: a game of a
  hundred players would measure moto's BatchGetItem, not chat.)
- Each comment's latency runs from its scheduled send time to its ``chatAck``
  (no coordinated omission: a late send counts its lateness). Only the steady
  phase's comments count, however late the warm-up's are answered. Every comment
  must be acknowledged; what is not is counted by kind: refused (an error frame
  naming it, by code), a send that failed, or no answer at all, beside the
  authors' connections the server closed (by close code, with any error frame
  it sent first).

Where the time goes: the nodes' chat counters over the steady phase give the
batches (comments per batch), and each batch's mean wait for the game's lock,
``GAMECOMMENTS`` append and publish; with the stand-in's GetItem time probed
twice a second beside them. (moto copies the whole item on every UpdateItem, so
its append grows with the game's comments: hundreds here.) After the run, the
same appends go straight to the stand-in, one at a time at the same rate, with no
node (``store_append_floor``): the part of the p99 that is moto's own.

Authors run in this process on the ``websockets`` client: a few sockets and
twenty comments a second are far below what one event loop handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import boto3
from websockets.asyncio.client import ClientConnection, connect

from loadtest.harness.runner import Run
from loadtest.harness.servers import (
    FAKE_AWS,
    HOST,
    Proc,
    create_table,
    start_moto,
    start_ours,
    start_redis,
)
from loadtest.harness.worker import mint_token
from loadtest.report.stats import Histogram
from loadtest.report.targets import Target, check
from loadtest.scenarios.abuse import run_metrics

Result = dict[str, Any]

META, GAME_ID = "loadtest", "chat-1"
TARGETS = {
    "p99": Target(
        "chat", "p99 post -> chatAck, one game from 2 nodes", "ms", "<=", 50.0, ("rate", 20)
    ),
    "unanswered": Target("chat", "comments not acknowledged", "", "<=", 0),
}


FLOOD_WINDOW_SECONDS = 20

BATCH_COUNTERS = {
    "lock_wait_ms": "ap_chat_batch_lock_wait_seconds_total",
    "store_append_ms": "ap_chat_batch_store_seconds_total",
    "publish_ms": "ap_chat_batch_publish_seconds_total",
}
"""Where the nodes' batches spent their time (each a sum; ÷ batches: the mean)."""


@dataclass
class Tally:
    """One phase's comments."""

    latency: Histogram = field(default_factory=Histogram)
    acks: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    send_failed: int = 0


@dataclass
class Author:
    user_id: str
    ws: ClientConnection | None = None
    # clientMsgId -> (scheduled ns, the phase it counts in)
    sent: dict[str, tuple[int, Tally]] = field(default_factory=dict)


@dataclass
class Connections:
    """What the authors' connections heard besides answers to their comments."""

    chat_events: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # error frames naming no comment
    closed_by_server: Counter[str] = field(default_factory=Counter)  # by close code


def _client(endpoint: str) -> Any:
    return boto3.client(
        "dynamodb",
        endpoint_url=endpoint,
        region_name=FAKE_AWS["AWS_DEFAULT_REGION"],
        aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=FAKE_AWS["AWS_SECRET_ACCESS_KEY"],
    )


def probe_store(endpoint: str, table: str, stop: threading.Event) -> Histogram:
    """The DynamoDB stand-in's own answer time, twice a second: a comment holds the
    game's lock for one of its appends, so this bounds how many a game takes."""
    client = _client(endpoint)
    times = Histogram()
    while not stop.wait(0.5):
        started = time.perf_counter()
        client.get_item(
            TableName=table, Key={"pk": {"S": "GAME"}, "sk": {"S": f"{META}#0#{GAME_ID}"}}
        )
        times.record(int((time.perf_counter() - started) * 1e6))
    return times


def append_floor(endpoint: str, table: str, rate: float, count: int) -> Histogram:
    """The stand-in's own time for the write a comment waits for: ``count`` appends to
    a fresh ``GAMECOMMENTS`` item, one at a time at ``rate`` a second, in the shape of
    the server's usual conditional append (``server/store/dynamodb_records.py``,
    ``_append_counted``), with no node, lock or Redis. Our p99 cannot beat this one."""
    client = _client(endpoint)
    key = {"pk": {"S": "GAMECOMMENTS"}, "sk": {"S": f"floor-{uuid.uuid4().hex[:8]}"}}
    client.put_item(
        TableName=table,
        Item={**key, "comments": {"L": []}, "commentBytes": {"N": "0"}, "commentIds": {"M": {}}},
    )
    times = Histogram()
    start = time.monotonic()
    for index in range(count):
        delay = start + index / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        comment = {
            "comment": {"S": f"comment {index} on the floor"},
            "userId": {"S": f"author-{index % 4}"},
            "moveNumber": {"N": "3"},
            "timeStamp": {"N": str(1_700_000_000_000 + index)},
        }
        started = time.perf_counter()
        client.update_item(
            TableName=table,
            Key=key,
            UpdateExpression="SET #c = list_append(#c, :new), #ids.#k = :ts ADD #b :w",
            ConditionExpression="#b < :room AND attribute_not_exists(#ids.#k)",
            ExpressionAttributeNames={
                "#c": "comments",
                "#b": "commentBytes",
                "#ids": "commentIds",
                "#k": f"floor{index:07d}",
            },
            ExpressionAttributeValues={
                ":new": {"L": [{"M": comment}]},
                ":ts": {"N": "1"},
                ":w": {"N": "110"},
                ":room": {"N": "1000000"},
            },
        )
        times.record(int((time.perf_counter() - started) * 1e6))
    return times


def seed_game(endpoint: str, table: str, players: list[str]) -> None:
    client = _client(endpoint)
    client.put_item(
        TableName=table,
        Item={
            "pk": {"S": "GAME"},
            "sk": {"S": f"{META}#0#{GAME_ID}"},
            "players": {"L": [{"M": {"id": {"S": p}, "name": {"S": p}}} for p in players]},
        },
    )


async def read_replies(author: Author, heard: Connections, closing: asyncio.Event) -> None:
    ws = author.ws
    assert ws is not None
    with contextlib.suppress(Exception):
        async for data in ws:
            message = json.loads(data)
            verb = message.get("verb")
            if verb == "chat":
                heard.chat_events += 1
                continue
            if verb not in ("chatAck", "error"):
                continue
            payload = message.get("payload") or {}
            entry = author.sent.pop(payload.get("clientMsgId") or "", None)
            if entry is None:
                if verb == "error":  # a refusal of the connection, not of a comment
                    heard.errors[str(payload.get("code"))] += 1
                continue
            scheduled, tally = entry
            if verb == "chatAck":
                tally.acks += 1
                tally.latency.record(max(0, (time.time_ns() - scheduled) // 1000))
            else:
                tally.refused[str(payload.get("code"))] += 1
    if not closing.is_set():
        heard.closed_by_server[str(ws.close_code)] += 1


async def join(author: Author, url: str, secret: str) -> None:
    author.ws = await connect(url, open_timeout=30, compression=None, max_size=None)
    subscribe = {
        "action": "subscribe",
        "token": mint_token(secret, author.user_id),
        "games": [{"meta": META, "id": GAME_ID}],
        "watchVersion": 1,
        "wantsPresence": False,
    }
    await author.ws.send(json.dumps(subscribe))


async def node_counters(nodes: list[Proc]) -> dict[str, float]:
    """The chat counters, summed over the nodes."""
    total: dict[str, float] = {}
    for values in await asyncio.gather(*(run_metrics(node) for node in nodes)):
        for name, value in values.items():
            if name.startswith("ap_chat_"):
                total[name] = total.get(name, 0.0) + value
    return total


def batch_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The steady phase's batches: how many comments each, and each step's mean."""

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    batches = grew("ap_chat_batches_total")
    stored = grew("ap_chat_comments_stored_total")
    figures = {
        "batches": batches,
        "comments_per_batch": round(stored / max(1, batches), 2),
        # authorizations: GAME row reads, and answers from the row a node kept
        "game_row_reads": grew("ap_chat_access_reads_total"),
        "game_row_kept": grew("ap_chat_access_cached_total"),
    }
    for key, name in BATCH_COUNTERS.items():
        figures[f"mean_{key}"] = round(grew(name) * 1000 / max(1, batches), 2)
    return figures


async def post_at_rate(
    authors: list[Author], rate: float, seconds: float, tally: Tally
) -> tuple[int, float]:
    """Comments at ``rate`` a second, round-robin; (sent, lateness of the last in s)."""
    start = time.time() + 0.2
    total = int(rate * seconds)
    sent = 0
    late = 0.0
    for number in range(total):
        due = start + number / rate
        wait = due - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        late = max(late, time.time() - due)
        author = authors[number % len(authors)]
        msg_id = uuid.uuid4().hex
        author.sent[msg_id] = (int(due * 1e9), tally)
        comment = {
            "action": "chat",
            "meta": META,
            "id": GAME_ID,
            "comment": f"comment {number} from {author.user_id}",
            "moveNumber": 1,
            "clientMsgId": msg_id,
        }
        assert author.ws is not None
        try:
            await author.ws.send(json.dumps(comment))
            sent += 1
        except Exception:
            author.sent.pop(msg_id, None)
            tally.send_failed += 1
    return sent, late


async def chat(run: Run) -> Result:
    options = run.options
    count = options.connections
    rate = options.rate or 20.0
    run.progress.log("starting redis-server and moto_server")
    redis_proc, redis_url = await start_redis()
    run.track(redis_proc)
    moto_proc, endpoint = await start_moto()
    run.procs.append(moto_proc)  # moto stands in for DynamoDB: not under test
    table = f"loadtest-{uuid.uuid4().hex[:8]}"
    await create_table(endpoint, table)
    authors = [Author(f"author{index}") for index in range(count)]
    await asyncio.to_thread(seed_game, endpoint, table, [a.user_id for a in authors])
    # Enough room in the per-user rate and the per-socket flood credits for the
    # round-robin (twice what it needs), so neither limit is what is measured.
    per_author = rate / max(1, count)  # comments a second
    per_user = max(5, int(2 * 10 * per_author) + 1)
    flood = max(50, int(2 * FLOOD_WINDOW_SECONDS * per_author) + 10)
    nodes: list[Proc] = []
    for index in range(2):
        proc = await start_ours(
            f"node-{index + 1}",
            run.secrets,
            debounce_ms=options.debounce_ms,
            extra_args=[
                f"--chat-rate={per_user}",
                f"--flood-credits={flood}",
                f"--flood-window-seconds={FLOOD_WINDOW_SECONDS}",
                *options.server_args,
            ],
            cluster=(redis_url, endpoint, table),
        )
        nodes.append(run.track(proc))
    run.add_server("cluster", nodes)
    warmup, steady = Tally(), Tally()
    heard = Connections()
    closing = asyncio.Event()
    urls = [f"ws://{HOST}:{proc.ws_port}/" for proc in nodes]
    await asyncio.gather(*(join(a, urls[i % 2], run.secrets.jwt) for i, a in enumerate(authors)))
    readers = [asyncio.create_task(read_replies(a, heard, closing)) for a in authors]
    try:
        await asyncio.sleep(1.0)  # the subscribes are answered
        run.activate("cluster", "warmup")
        await post_at_rate(authors, rate, options.warmup_seconds, warmup)
        await asyncio.sleep(1.0)
        run.progress.log(f"cluster: {rate:g} comments/s on one game for {options.duration:g} s")
        run.activate("cluster", "steady")
        before = run.meter()
        counters_before = await node_counters(nodes)
        stop_probe = threading.Event()
        probe = asyncio.create_task(asyncio.to_thread(probe_store, endpoint, table, stop_probe))
        try:
            sent, late = await post_at_rate(authors, rate, options.duration, steady)
        finally:
            stop_probe.set()
            store_times = await probe
        for _ in range(100):  # every answer, or 10 s
            if not any(a.sent for a in authors):
                break
            await asyncio.sleep(0.1)
        meter = run.interval(before, run.meter(), "cluster")
        batches = batch_figures(counters_before, await node_counters(nodes))
        run.progress.log("the stand-in's own appends at the same rate, with no node")
        floor = await asyncio.to_thread(append_floor, endpoint, table, rate, max(1, sent))
    finally:
        closing.set()
        for author in authors:
            if author.ws is not None:
                await author.ws.close()
        await asyncio.gather(*readers, return_exceptions=True)
    comments = sent + steady.send_failed
    unanswered = sum(1 for a in authors for _, tally in a.sent.values() if tally is steady)
    refused = sum(steady.refused.values())
    figures = {
        "authors": count,
        "nodes": 2,
        "rate_per_s": rate,
        "comments": comments,
        "acks": steady.acks,
        "refused": dict(steady.refused),
        "send_failed": steady.send_failed,
        "unanswered": unanswered,
        "connection_errors": dict(heard.errors),
        "closed_by_server": dict(heard.closed_by_server),
        "last_send_late_ms": round(late * 1000, 2),
        "post_to_ack": steady.latency.summary_ms(),
        "chat_events_received": heard.chat_events,
        "store_get_item": store_times.summary_ms(),
        "store_append_floor": floor.summary_ms(),
        "batches": batches,
        "server_limits": {"chat_rate_per_10s": per_user, "flood_credits": flood},
        **meter,
    }
    p99 = steady.latency.percentile(0.99) / 1000 if steady.latency.count else float("nan")
    kinds = (
        f"refused {dict(steady.refused)}, send failed {steady.send_failed}, "
        f"no answer {unanswered}; server closes {dict(heard.closed_by_server)}"
    )
    targets = [
        check(
            TARGETS["p99"],
            p99,
            int(rate),
            note=(
                f"{comments} comments from {count} authors; the stand-in's own append "
                f"alone: p99 {floor.percentile(0.99) / 1000:.0f} ms"
            ),
        ),
        check(
            TARGETS["unanswered"],
            refused + steady.send_failed + unanswered if comments else float("nan"),
            count,
            note=f"of {comments}: {kinds}",
        ),
    ]
    return {"servers": {"chat": figures}, "targets": targets}
