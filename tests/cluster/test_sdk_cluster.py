"""The Python SDK across real node processes on one Redis: a drain (1012) and a
kill -9 each recovered on another node with every event once, a Redis restart
without its data answered by one resync, and a silent (stopped) node replaced.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

from apclient import Disconnected, RealtimeClient
from tests.client import dev_token
from tests.cluster.harness import SLACK, Cluster
from tests.sdk_support import Recorder
from tests.services import RedisServer

GAME = ("chess", "sdk")
STREAM = "game:chess#sdk"
BUDGET = 20 + SLACK


class Gate:
    """A get_token that can hold the next connect."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        await self.open.wait()
        return dev_token("alice")


async def publish(cluster: Cluster, node: str, n: int) -> dict[str, object]:
    """One game event with payload ``n`` through ``node``, retried while the node
    cannot reach Redis yet (503)."""
    body = {"verb": "game", "payload": {"meta": GAME[0], "id": GAME[1], "n": n}}
    deadline = asyncio.get_running_loop().time() + BUDGET
    while True:
        status, reply = await cluster.publish_reply(node, body)
        if status == 202 and reply["positions"]:
            position: dict[str, object] = reply["positions"][STREAM]
            return position
        assert asyncio.get_running_loop().time() < deadline, (status, reply)
        await asyncio.sleep(0.1)


def client_for(
    cluster: Cluster, *names: str, get_token: Callable[[], Any] | None = None
) -> RealtimeClient:
    urls = [cluster.nodes[name].ws_url for name in names]
    return RealtimeClient(
        urls,
        get_token=get_token or (lambda: dev_token("alice")),
        games=[GAME],
        rand=lambda: 0.0,
    )


async def test_a_drain_moves_the_client_and_it_misses_nothing(pair: Cluster) -> None:
    await pair.start("n1", "n2", drain_seconds=1)
    client = client_for(pair, "n1", "n2")
    rec = Recorder().attach(client)
    async with client:
        await rec.until(lambda: rec.connects == 1, "connected to n1", BUDGET)
        for n in range(3):
            await publish(pair, "n2", n)
        draining = asyncio.create_task(pair.terminate("n1"))
        for n in range(3, 10):  # before, during and after the drain
            await publish(pair, "n2", n)
            await asyncio.sleep(0.1)
        await draining
        await rec.until(lambda: rec.payloads() == list(range(10)), "every event", BUDGET)
        assert rec.disconnects[0].code == 1012 and rec.disconnects[0].will_reconnect
        assert rec.connects == 2 and rec.resyncs == []
        game = [r for r in rec.recovered if r.stream == STREAM]
        assert game[-1].was_recovering and game[-1].recovered


async def test_a_kill_9_is_recovered_on_another_node(pair: Cluster) -> None:
    await pair.start("n1", "n2")
    client = client_for(pair, "n1", "n2")
    rec = Recorder().attach(client)
    async with client:
        await rec.until(lambda: rec.connects == 1, "connected to n1", BUDGET)
        await publish(pair, "n2", 0)
        await rec.until(lambda: rec.payloads() == [0], "a live event", BUDGET)
        pair.kill("n1")
        for n in range(1, 6):
            await publish(pair, "n2", n)
        await rec.until(lambda: rec.payloads() == list(range(6)), "every event", BUDGET)
        assert rec.disconnects[0].code == 1006 and rec.disconnects[0].retry_in == 0.5
        game = [r for r in rec.recovered if r.stream == STREAM]
        assert (game[-1].was_recovering, game[-1].recovered) == (True, True)
        assert rec.resyncs == []


async def test_a_redis_restart_without_data_resyncs_once(pair: Cluster) -> None:
    await pair.start("n1", "n2")
    gate = Gate()
    client = client_for(pair, "n1", "n2", get_token=gate)
    rec = Recorder().attach(client)
    async with client:
        await rec.until(lambda: rec.connects == 1, "connected to n1", BUDGET)
        first = await publish(pair, "n2", 0)
        await rec.until(lambda: rec.payloads() == [0], "a live event", BUDGET)
        gate.open.clear()  # away while Redis loses everything
        pair.kill("n1")
        await rec.until(lambda: len(rec.disconnects) == 1, "the kill", BUDGET)
        assert isinstance(pair.redis, RedisServer)
        pair.redis.restart()
        await pair.wait_ready("n2", within=BUDGET)
        second = await publish(pair, "n2", 1)  # the stream starts a new epoch
        assert second["epoch"] != first["epoch"]
        gate.open.set()
        # one resync per stream the client held: its game, and its own user stream
        await rec.until(lambda: len(rec.resyncs) == 2, "the resyncs", BUDGET)
        assert sorted(r.stream for r in rec.resyncs) == [STREAM, "user:alice"]
        (resync,) = [r for r in rec.resyncs if r.stream == STREAM]
        assert (resync.reason, resync.was_recovering, resync.recovered) == ("recovery", True, False)
        assert (resync.epoch, resync.offset) == (second["epoch"], second["offset"])
        await publish(pair, "n2", 2)
        await rec.until(lambda: rec.payloads() == [0, 2], "live events go on", BUDGET)
        assert len(rec.resyncs) == 2  # once each, not again at the next event
        assert client.positions[STREAM].epoch == second["epoch"]


async def test_a_stopped_node_is_left_for_another_within_three_heartbeats(pair: Cluster) -> None:
    await pair.start("n1", "n2", heartbeat_seconds=1)
    client = client_for(pair, "n1", "n2")
    rec = Recorder().attach(client)
    async with client:
        await rec.until(lambda: rec.connects == 1, "connected to n1", BUDGET)
        pair.nodes["n1"].process.send_signal(signal.SIGSTOP)  # alive, silent
        try:
            for n in range(3):
                await publish(pair, "n2", n)
            await rec.until(lambda: rec.payloads() == [0, 1, 2], "the events, via n2", BUDGET)
            assert rec.disconnects[0] == Disconnected(1006, "read timeout", True, 0.5)
            await rec.until(lambda: rec.connects == 2, "connected to n2", BUDGET)
        finally:
            pair.nodes["n1"].process.send_signal(signal.SIGCONT)
