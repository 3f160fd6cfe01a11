"""The held-stream audit against a real Redis: an event committed but never heard is
found at the second audit that still misses it, and one merely in flight is not.

The node side is the benchmark's stand-in (``Held``): cursors, as ``StreamDelivery``
holds them, and the streams it was asked to check; the reads are ``RedisStreams``'.
The last tests run a whole node: the event reaches the tab, found by the audit or,
when a later event shows the hole, as that event arrives. And when the history
stays unreadable past the node's patience (``--history-patience-seconds``), a
repair or a recovery tells the tab ``recovered: false`` instead of keeping it
waiting, and live events go on."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from loadtest.harness.faults import TcpFaultProxy
from loadtest.scenarios.stream_audit import Held
from protocol.envelope import encode_envelope
from protocol.messages import Position
from protocol.parse import parse_broadcast
from protocol.streams import StreamCursor
from server.bus.redis_streams import READ, RedisStreams, history_key, meta_key
from server.bus.topics import stream_topic
from server.redis.scripts import Script
from server.routing.history_reads import PATIENCE_S
from server.routing.stream_audit import StreamAudit
from server.runtime.metrics import Registry
from tests.client import Client
from tests.conftest import TEST_SETTINGS, RunningServer, run_server
from tests.services import RedisServer


@pytest.fixture
async def streams(fresh_redis: RedisServer) -> AsyncIterator[RedisStreams]:
    streams = RedisStreams(fresh_redis.url)
    await streams.start()
    yield streams
    await streams.close()


def game(name: str = "audit") -> str:
    return f"game:{name}#{uuid.uuid4().hex[:8]}"


async def held_at_top(streams: RedisStreams, held: Held, stream: str, events: int) -> None:
    """``events`` appended and all heard: the cursor is at the top."""
    position = None
    for index in range(events):
        position = await streams.append(stream, f"e{index}".encode(), ())
    assert position is not None
    held.cursors[stream] = StreamCursor(position.epoch, position.offset)


async def test_an_event_never_heard_is_reported_at_the_second_audit(
    streams: RedisStreams,
) -> None:
    held, topics, metrics = Held(), list[str](), Registry()
    audit = StreamAudit(held, streams, metrics, interval=30, on_missed=topics.append)
    lost, quiet = game(), game()
    await held_at_top(streams, held, lost, 2)
    await held_at_top(streams, held, quiet, 3)
    await streams.append(lost, b"the move nobody heard", ())  # its publish went nowhere
    behind = await audit.audit({})
    assert held.checked == []  # it may be in flight yet
    assert behind == {lost: (held.cursors[lost].epoch, 3)}
    assert await audit.audit(behind) == {}
    assert held.checked == [lost]
    assert topics == [stream_topic(lost)] and topics[0].startswith("game:")
    assert metrics.value("ap_stream_audit_missed_total") == 1


async def test_an_event_heard_between_two_audits_is_not_reported(
    streams: RedisStreams,
) -> None:
    held, topics, metrics = Held(), list[str](), Registry()
    audit = StreamAudit(held, streams, metrics, interval=30, on_missed=topics.append)
    stream = game()
    await held_at_top(streams, held, stream, 1)
    position = await streams.append(stream, b"in flight", ())
    behind = await audit.audit({})
    assert stream in behind
    held.cursors[stream].offset = position.offset  # it arrived
    # Another is in flight by the second audit: behind again, but not the same.
    await streams.append(stream, b"next", ())
    behind = await audit.audit(behind)
    assert held.checked == [] and topics == []
    assert behind == {stream: (position.epoch, 3)}
    assert metrics.value("ap_stream_audit_missed_total") == 0


async def test_a_stream_whose_check_is_under_way_is_left_to_it(streams: RedisStreams) -> None:
    # Reported at one audit, its repair still reading at the next two: no second
    # report (the count and the resubscribe would double for one loss).
    held, topics, metrics = Held(), list[str](), Registry()
    audit = StreamAudit(held, streams, metrics, interval=30, on_missed=topics.append)
    stream = game()
    await held_at_top(streams, held, stream, 1)
    await streams.append(stream, b"lost", ())
    behind = await audit.audit(await audit.audit({}))
    assert held.checked == [stream]
    held.under_repair.add(stream)
    for _ in range(2):
        behind = await audit.audit(behind)
        assert behind == {}
    assert held.checked == [stream] and len(topics) == 1
    assert metrics.value("ap_stream_audit_missed_total") == 1


async def test_streams_nobody_delivered_on_and_streams_in_step_cost_nothing(
    streams: RedisStreams,
) -> None:
    held, metrics = Held(), Registry()
    audit = StreamAudit(held, streams, metrics, interval=30, batch=2)  # several batches
    in_step = [game() for _ in range(5)]
    for stream in in_step:
        await held_at_top(streams, held, stream, 2)
    held.cursors[game("unknown")] = StreamCursor()  # held, no epoch known yet
    assert await audit.audit({}) == {}
    assert await audit.audit({}) == {}
    assert held.checked == []


async def test_a_stream_restarted_empty_is_repaired_without_blaming_the_bus(
    streams: RedisStreams, fresh_redis: RedisServer
) -> None:
    # Its history expired (or Redis lost it): the audit's read starts a new epoch
    # at top 0. The tabs must learn the old one is gone, but no event went astray.
    held, topics, metrics = Held(), list[str](), Registry()
    audit = StreamAudit(held, streams, metrics, interval=30, on_missed=topics.append)
    user = f"user:audit-{uuid.uuid4().hex[:8]}"
    await held_at_top(streams, held, user, 4)
    client = aioredis.Redis.from_url(fresh_redis.url)
    try:
        assert await client.delete(meta_key(user), history_key(user)) == 2
    finally:
        await client.aclose()
    behind = await audit.audit({})
    assert behind[user][1] == 0 and behind[user][0] != held.cursors[user].epoch
    await audit.audit(behind)
    assert held.checked == [user]
    assert topics == []  # nothing to resubscribe for
    assert stream_topic(user) == user


async def test_the_audit_runs_on_its_own_until_stopped(streams: RedisStreams) -> None:
    held, metrics = Held(), Registry()
    audit = StreamAudit(held, streams, metrics, interval=0.01)
    stream = game()
    await held_at_top(streams, held, stream, 1)
    await streams.append(stream, b"lost", ())
    await audit.start()
    try:
        for _ in range(1000):
            if held.checked:
                break
            await asyncio.sleep(0.01)
    finally:
        await audit.stop()
    assert held.checked and set(held.checked) == {stream}
    count = len(held.checked)
    await asyncio.sleep(0.05)
    assert len(held.checked) == count  # stopped


async def test_a_move_whose_publish_never_arrived_reaches_the_tab(
    fresh_redis: RedisServer,
) -> None:
    # A node of a cluster, with the audit every 50 ms: move 2 is committed to the
    # game's stream (as another node's publish would), but its pub/sub message never
    # reaches this node, and no later move shows the hole.
    async with heard_move_1(fresh_redis.url, stream_audit_seconds=0.05) as (server, watcher):
        position = await append_unheard(fresh_redis.url, CHESS, move(2))
        assert position.offset == 2
        await watcher.wait_for(lambda: watcher.offsets(CHESS) == [1, 2])
        frame = watcher.on_stream(CHESS)[1]
        assert frame["payload"]["n"] == 2 and frame["epoch"] == position.epoch
        assert server.node.metrics.value("ap_stream_audit_missed_total") == 1


async def test_a_move_whose_publish_never_arrived_is_filled_in_when_the_next_one_comes(
    fresh_redis: RedisServer,
) -> None:
    # The audit out of the way: here the next move shows the hole as it arrives (a
    # live gap), and the node reads the missing move from history before it
    # delivers the next one.
    async with heard_move_1(fresh_redis.url, stream_audit_seconds=3600) as (server, watcher):
        await append_unheard(fresh_redis.url, CHESS, move(2))
        assert (await server.publish(move(3)))[0] == 202
        await watcher.wait_for(lambda: len(watcher.offsets(CHESS)) == 3)
        assert watcher.offsets(CHESS) == [1, 2, 3]
        assert [frame["payload"]["n"] for frame in watcher.on_stream(CHESS)] == [1, 2, 3]
        metrics = server.node.metrics
        assert metrics.value("ap_stream_gaps_total") == 1
        # Read from history: move 2, and move 3 itself (appended before it was heard).
        assert metrics.value("ap_stream_repaired_events_total") == 2
        assert metrics.value("ap_stream_audit_missed_total") == 0


async def test_a_hole_whose_history_stays_unreadable_is_told_lost_and_live_goes_on(
    fresh_redis: RedisServer, redis_proxy: TcpFaultProxy
) -> None:
    # As above, but every history read is cut before it reaches Redis for longer
    # than the node's patience: the tab learns that move 2 is lost, then gets move 3.
    async with heard_move_1(
        redis_proxy.url, stream_audit_seconds=0, history_patience_seconds=1.0
    ) as (server, watcher):
        epoch = watcher.on_stream(CHESS)[0]["epoch"]
        await append_unheard(fresh_redis.url, CHESS, move(2))
        redis_proxy.cut_before(READ_SHA, 1000)
        assert (await server.publish(move(3)))[0] == 202
        lost = await watcher.wait_recovered(CHESS, within=PATIENCE_S / 2)
        assert lost == {"stream": CHESS, "recovered": False, "epoch": epoch, "offset": 2}
        await watcher.wait_for(lambda: watcher.offsets(CHESS) == [1, 3])
        metrics = server.node.metrics
        assert metrics.value("ap_stream_gaps_total") == 1
        assert metrics.value("ap_stream_repaired_events_total") == 0
        assert metrics.value("ap_stream_losses_total") == 1
        assert redis_proxy.cuts_before_write >= 1


async def test_a_recovery_whose_history_stays_unreadable_answers_lost_then_live_goes_on(
    redis_proxy: TcpFaultProxy,
) -> None:
    # A tab back after move 1, while every history read is cut before it reaches
    # Redis for longer than the node's patience: recovered: false in the tab's
    # epoch (nothing can be proven), then the next move live.
    async with heard_move_1(
        redis_proxy.url, stream_audit_seconds=0, history_patience_seconds=1.0
    ) as (server, watcher):
        epoch = watcher.on_stream(CHESS)[0]["epoch"]
        await watcher.close()
        redis_proxy.cut_before(READ_SHA, 1000)
        since = {CHESS: {"epoch": epoch, "offset": 1}}
        again = await server.subscribed("alice", games=GAMES, since=since)
        # Well before the default patience: the setting is what answers.
        answer = await again.wait_recovered(CHESS, within=PATIENCE_S / 2)
        assert answer == {"stream": CHESS, "recovered": False, "epoch": epoch, "offset": 0}
        # (How many tries fit in the patience depends on the CPU the node gets.)
        assert server.node.metrics.value("ap_stream_recoveries_failed_total") == 1
        cuts = redis_proxy.cuts_before_write
        assert cuts >= 1
        redis_proxy.heal()
        assert (await server.publish(move(2)))[0] == 202
        await again.wait_for(lambda: again.offsets(CHESS) == [2])
        assert again.on_stream(CHESS)[0]["payload"]["n"] == 2
        assert redis_proxy.cuts_before_write == cuts


@contextlib.asynccontextmanager
async def heard_move_1(
    redis_url: str, **overrides: Any
) -> AsyncIterator[tuple[RunningServer, Client]]:
    """A cluster node on ``redis_url`` (with ``overrides`` to the test settings),
    and a tab on chess#g1 that has heard move 1 (offset 1)."""
    settings = dataclasses.replace(TEST_SETTINGS, redis_url=redis_url, **overrides)
    async with run_server(settings) as server:
        watcher = await server.subscribed("alice", games=GAMES, since={})
        status, reply = await server.publish(move(1))
        assert status == 202 and isinstance(reply, dict)
        await watcher.wait_for(lambda: watcher.offsets(CHESS) == [1])
        yield server, watcher


async def append_unheard(url: str, stream: str, event: dict[str, Any]) -> Position:
    """Commit ``event`` to ``stream`` as another node's publish would, but with no
    pub/sub message: no node hears it."""
    other = RedisStreams(url)
    await other.start()
    try:
        message = parse_broadcast(json.dumps(event).encode())
        return await other.append(stream, encode_envelope(message), ())
    finally:
        await other.close()


CHESS = "game:chess#g1"
GAMES = [("chess", "g1")]
READ_SHA = Script(READ).sha.encode()
"""In every history read's ``EVALSHA``, and in no other command."""


def move(n: int) -> dict[str, Any]:
    return {"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": n}}
