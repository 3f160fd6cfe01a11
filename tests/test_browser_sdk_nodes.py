"""The browser SDK in real Chromium against real nodes, each case provoked for real.

Two node processes on one Redis (``tests/cluster/harness.py``), with heartbeats every
2 s so that a silent socket is found in 6 s (and a node slowed by a loaded machine for
less than that is not taken for a silent one). ``tests/browser/sdk.html`` runs one
``RealtimeClient`` from the built bundle and records everything it reports;
``tests/browser/sdk_driver.mjs`` drives Chromium for the test over stdin/stdout.

To make "an event was missed while away" deterministic, the page's ``getToken`` can be
held: the client has left its socket and is waiting for a token while the test
publishes, then the test releases it and the client reconnects with its positions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.browser_sdk import build, node
from tests.client import dev_token
from tests.cluster.conftest import nodes_on
from tests.cluster.harness import Cluster
from tests.services import RedisServer, start_redis_server

DRIVER = "tests/browser/sdk_driver.mjs"
GAME_STREAM = "game:chess#g1"
CHESS = {"meta": "chess", "id": "g1"}
WAIT = 30.0
"""Every wait is for a condition; this bounds it on a loaded machine."""


class Chromium:
    """One headless Chromium, its pages steered through tests/browser/sdk_driver.mjs."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.ids = 0

    @classmethod
    async def start(cls) -> Chromium:
        chromium = shutil.which("chromium")
        assert chromium, "run scripts/bootstrap: it installs chromium"
        process = await asyncio.create_subprocess_exec(
            node(),
            DRIVER,
            json.dumps({"chromium": chromium}),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=1 << 24,
        )
        return cls(process)

    async def call(self, op: str, page: str, within: float = WAIT, **fields: Any) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.ids += 1
        command = {"id": self.ids, "op": op, "page": page, **fields}
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        await self.process.stdin.drain()
        line = await asyncio.wait_for(self.process.stdout.readline(), within + 30)
        assert line, "the Chromium driver exited"
        answer = json.loads(line)
        assert answer["id"] == self.ids
        assert answer["ok"], json.dumps(answer, indent=1)[-6000:]
        return answer["value"]

    async def open(self, page: str, config: dict[str, Any]) -> None:
        await self.call("open", page, config=config)

    async def eval(self, page: str, expr: str) -> Any:
        return await self.call("eval", page, expr=expr)

    async def wait(self, page: str, expr: str, within: float = WAIT) -> None:
        await self.call("wait", page, within, expr=expr, timeout=int(within * 1000))

    async def rt(self, page: str) -> dict[str, Any]:
        """Everything the page's client reported (functions left out)."""
        state: dict[str, Any] = await self.eval(page, "JSON.parse(JSON.stringify(rt))")
        return state

    async def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 20)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


@pytest.fixture
async def chromium() -> AsyncIterator[Chromium]:
    build()
    browser = await Chromium.start()
    try:
        yield browser
    finally:
        await browser.close()


@pytest.fixture
async def nodes(request: pytest.FixtureRequest, dynamodb_endpoint: str) -> AsyncIterator[Cluster]:
    """Nodes n1 and n2 on a Redis of the test's own, heartbeats every 2 s."""
    overrides = getattr(request, "param", {})
    redis = start_redis_server()
    try:
        async with nodes_on(
            redis, request, dynamodb_endpoint, ("n1", "n2"), heartbeat_seconds=2, **overrides
        ) as running:
            yield running
    finally:
        redis.stop()


def page(cluster: Cluster, on: str, *tokens: str, coalesce: list[str] | None = None) -> Any:
    return {
        "url": cluster.nodes[on].ws_url,
        "tokens": list(tokens) or [dev_token("alice")],
        "games": [CHESS],
        "coalesce": coalesce or [],
    }


async def move(cluster: Cluster, on: str, within: float = WAIT) -> dict[str, Any]:
    """Publish a move of chess#g1 through node ``on``; its position in the stream.

    Retried until the node can place it (right after a Redis restart it cannot yet).
    """
    deadline = asyncio.get_running_loop().time() + within
    while True:
        status, reply = await cluster.publish_reply(on, {"verb": "game", "payload": CHESS})
        if status == 202 and isinstance(reply, dict) and GAME_STREAM in reply["positions"]:
            position: dict[str, Any] = reply["positions"][GAME_STREAM]
            return position
        assert asyncio.get_running_loop().time() < deadline, (status, reply)
        await asyncio.sleep(0.1)


async def connected(browser: Chromium, name: str) -> None:
    await browser.wait(name, 'rt.state() === "connected"')


async def away(browser: Chromium, name: str, cluster: Cluster, to: str) -> None:
    """From now on the page reconnects to ``to``, and its next getToken waits for ``back``."""
    url = json.dumps(cluster.nodes[to].ws_url)
    await browser.eval(name, f"rt.url = {url}; rt.hold = true")


async def back(browser: Chromium, name: str, calls: int) -> None:
    """Wait for the page's ``calls``-th getToken (held), then let it through."""
    await browser.wait(name, f"rt.tokenCalls.length === {calls} && rt.release !== null")
    await browser.eval(name, "rt.hold = false; rt.release()")


def games(rt: dict[str, Any]) -> list[tuple[str, int, bool]]:
    return [
        (e["info"]["epoch"], e["info"]["offset"], e["info"]["replayed"])
        for e in rt["events"]
        if e["verb"] == "game"
    ]


def of(rt: dict[str, Any], verb: str) -> list[Any]:
    return [e["payload"] for e in rt["events"] if e["verb"] == verb]


async def test_a_drain_1012_reconnects_to_another_node_and_recovers(
    nodes: Cluster, chromium: Chromium
) -> None:
    await chromium.open("a", page(nodes, "n1"))
    await connected(chromium, "a")
    first = [await move(nodes, "n1") for _ in range(2)]
    await chromium.wait("a", 'rt.of("game").length === 2')
    await away(chromium, "a", nodes, "n2")
    await nodes.terminate("n1")  # SIGTERM: the node drains, closing with 1012
    await chromium.wait("a", "rt.tokenCalls.length === 2")
    missed = [await move(nodes, "n2") for _ in range(2)]
    await back(chromium, "a", 2)
    await chromium.wait(
        "a", f'rt.of("recovered").some(r => r.payload.stream === "{GAME_STREAM}" && r.at > 0)'
    )
    await connected(chromium, "a")
    rt = await chromium.rt("a")
    epoch = first[0]["epoch"]
    assert [p["offset"] for p in first + missed] == [1, 2, 3, 4]
    assert games(rt) == [(epoch, 1, False), (epoch, 2, False), (epoch, 3, True), (epoch, 4, True)]
    [drained] = of(rt, "disconnected")
    assert (drained["code"], drained["reason"], drained["willReconnect"]) == (
        1012,
        "server restarting",
        True,
    )
    assert 0 <= drained["retryIn"] <= 3000, "a drained node's clients come back within 0-3 s"
    game_answers = [r for r in of(rt, "recovered") if r["stream"] == GAME_STREAM]
    assert game_answers[-1] == {
        "stream": GAME_STREAM,
        "wasRecovering": True,
        "recovered": True,
        "replayed": 2,
    }
    assert rt["resyncs"] == []
    assert rt["states"] == ["connected", "connecting", "connected"]


async def test_kill_9_recovers_on_another_node_with_the_burst_coalesced(
    nodes: Cluster, chromium: Chromium
) -> None:
    await chromium.open("a", page(nodes, "n1", coalesce=["game"]))
    await connected(chromium, "a")
    await move(nodes, "n1")
    await chromium.wait("a", 'rt.of("game").length === 1')
    await away(chromium, "a", nodes, "n2")
    nodes.kill("n1")
    await chromium.wait("a", "rt.tokenCalls.length === 2")
    missed = [await move(nodes, "n2") for _ in range(20)]
    await back(chromium, "a", 2)
    await chromium.wait("a", 'rt.of("game").length === 2')
    await connected(chromium, "a")
    rt = await chromium.rt("a")
    [disconnect] = of(rt, "disconnected")
    assert disconnect["code"] == 1006 and disconnect["willReconnect"] is True
    burst = [e for e in rt["events"] if e["verb"] == "game"][1]
    assert burst["info"]["replayed"] is True
    assert burst["info"]["offset"] == missed[-1]["offset"] == 21
    assert len(burst["info"]["batch"]) == 20, "the page refetches once, not twenty times"
    game_answers = [r for r in of(rt, "recovered") if r["stream"] == GAME_STREAM]
    assert game_answers[-1]["recovered"] is True and game_answers[-1]["replayed"] == 20
    assert rt["resyncs"] == []
    await move(nodes, "n2")
    await chromium.wait("a", 'rt.of("game").length === 3')
    calls = [e for e in (await chromium.rt("a"))["events"] if e["verb"] == "game"]
    assert [len(e["info"]["batch"]) for e in calls] == [1, 20, 1], "live events are not held"


async def test_a_redis_restart_without_data_calls_resync_once(
    nodes: Cluster, chromium: Chromium
) -> None:
    await chromium.open("a", page(nodes, "n1"))
    await connected(chromium, "a")
    before = [await move(nodes, "n1") for _ in range(2)]
    await chromium.wait("a", 'rt.of("game").length === 2')
    await away(chromium, "a", nodes, "n1")
    await chromium.eval("a", "client.reconnectNow()")
    await chromium.wait("a", "rt.tokenCalls.length === 2")
    assert isinstance(nodes.redis, RedisServer)
    nodes.redis.restart()
    after = await move(nodes, "n1")  # the stream starts again: a new epoch
    assert after["epoch"] != before[0]["epoch"] and after["offset"] == 1
    await back(chromium, "a", 2)
    await chromium.wait("a", f'rt.resyncs.some(r => r.stream === "{GAME_STREAM}")')
    await connected(chromium, "a")
    rt = await chromium.rt("a")
    resyncs = [r for r in rt["resyncs"] if r["stream"] == GAME_STREAM]
    assert resyncs == [
        {
            "stream": GAME_STREAM,
            "reason": "recovery",
            "wasRecovering": True,
            "recovered": False,
            "replayed": 0,
            "epoch": after["epoch"],
            "offset": 1,
        }
    ]
    assert len(games(rt)) == 2, "nothing is replayed from a history that is gone"
    await move(nodes, "n1")
    await chromium.wait("a", 'rt.of("game").length === 3')
    rt = await chromium.rt("a")
    assert games(rt)[-1] == (after["epoch"], 2, False)
    assert len([r for r in rt["resyncs"] if r["stream"] == GAME_STREAM]) == 1


@pytest.mark.parametrize("nodes", [{"max_connections_per_user": 1}], indirect=True)
async def test_4509_stops_the_client(nodes: Cluster, chromium: Chromium) -> None:
    await chromium.open("first", page(nodes, "n1"))
    await connected(chromium, "first")
    await chromium.open("second", page(nodes, "n1"))
    await chromium.wait("second", 'rt.state() === "disconnected"')
    rt = await chromium.rt("second")
    assert of(rt, "disconnected") == [
        {"code": 4509, "reason": "too many connections", "willReconnect": False, "retryIn": None}
    ]
    assert [e["code"] for e in of(rt, "error")] == ["too_many_connections"]
    assert len(rt["tokenCalls"]) == 1
    assert rt["states"] == ["disconnected"]
    assert await chromium.eval("first", "rt.state()") == "connected"


@pytest.mark.parametrize("nodes", [{"max_connections": 1}], indirect=True)
async def test_a_503_at_upgrade_backs_off_with_the_longer_floor(
    nodes: Cluster, chromium: Chromium
) -> None:
    """A browser never sees the 503, only a socket that did not open: the 5 s floor."""
    await chromium.open("first", page(nodes, "n1"))
    await connected(chromium, "first")
    await chromium.open("second", page(nodes, "n1"))
    await chromium.wait("second", "rt.tokenCalls.length === 2")
    await chromium.eval("first", "client.close()")
    await connected(chromium, "second")
    rt = await chromium.rt("second")
    refused = of(rt, "disconnected")
    assert refused and all(d["code"] == 1006 and d["willReconnect"] for d in refused)
    # Timers never fire early, however loaded the machine: a lower bound is safe.
    waited = rt["tokenCalls"][1]["at"] - rt["events"][0]["at"]
    assert waited >= 5000, f"retried after {waited:.0f} ms"
    assert await nodes.metric("n1", "ap_refused_upgrades_total") >= 1


async def test_1008_refreshes_the_token_once(nodes: Cluster, chromium: Chromium) -> None:
    expired = dev_token("alice", expires_in=-60)
    forged = dev_token("alice", secret="not-the-server-secret-0123456789abcdef")
    await chromium.open("stops", page(nodes, "n1", expired, forged))
    await chromium.open("refreshed", page(nodes, "n1", expired, dev_token("alice")))
    await chromium.wait("stops", 'rt.state() === "disconnected"')
    await connected(chromium, "refreshed")
    stops = await chromium.rt("stops")
    assert [call["refresh"] for call in stops["tokenCalls"]] == [False, True]
    assert [(d["code"], d["willReconnect"]) for d in of(stops, "disconnected")] == [
        (1008, True),
        (1008, False),
    ]
    assert [e["code"] for e in of(stops, "error")] == ["unauthorized", "unauthorized"]
    refreshed = await chromium.rt("refreshed")
    assert [call["refresh"] for call in refreshed["tokenCalls"]] == [False, True]


async def test_a_silent_socket_is_replaced(nodes: Cluster, chromium: Chromium) -> None:
    await chromium.open("a", page(nodes, "n1"))
    await connected(chromium, "a")
    await move(nodes, "n1")
    await chromium.wait("a", 'rt.of("game").length === 1')
    await away(chromium, "a", nodes, "n2")
    await chromium.eval("a", "rt.hold = false")
    before = len(of(await chromium.rt("a"), "disconnected"))
    nodes.nodes["n1"].process.send_signal(signal.SIGSTOP)  # the socket stays open, silent
    try:
        missed = await move(nodes, "n2")
        await chromium.wait("a", 'rt.of("game").length === 2')
        await connected(chromium, "a")
        rt = await chromium.rt("a")
        [silent] = of(rt, "disconnected")[before:]
        assert (silent["code"], silent["reason"], silent["willReconnect"]) == (
            1006,
            "read timeout",
            True,
        )
        assert games(rt)[-1] == (missed["epoch"], 2, True)
        answer = [r for r in of(rt, "recovered") if r["stream"] == GAME_STREAM][-1]
        assert (answer["recovered"], answer["replayed"]) == (True, 1)
    finally:
        with contextlib.suppress(OSError):
            nodes.nodes["n1"].process.send_signal(signal.SIGCONT)
