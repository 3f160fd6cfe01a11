"""A primary of the Redis Cluster is killed (kill -9) while events flow: how long
until delivery resumes, and is anything lost?

One probe client per node watches one game whose channel lives on the primary
that will be killed, speaking streams (so every event carries its offset). A
publisher posts an event for that game every ``interval`` seconds, through
the nodes in turn, and records what was accepted (202). Then:

- *resumed after*: from the kill to the arrival of the first event published
  after it (the slowest probe decides; an event published before the kill
  and still in flight does not count, it shows in the slowest publish);
- *lost*: accepted events a probe never received, over all probes;
- *gaps*: breaks in a probe's offsets (a client would have to refetch).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import websockets
from redis.crc import key_slot

from loadtest.clients.http import HttpConnection
from loadtest.harness.redis_cluster import RedisCluster
from loadtest.harness.servers import HOST, Proc
from loadtest.harness.worker import mint_token
from server.redis.keys import channel_for


@dataclass
class Probe:
    node: str
    received: dict[str, float] = field(default_factory=dict)  # event id -> arrival (monotonic)
    offsets: list[int] = field(default_factory=list)


def game_on(cluster: RedisCluster, port: int) -> str:
    """A game id whose channel's slot is served by the primary on ``port``."""
    i = 0
    while cluster.owner(key_slot(channel_for(f"game:failover#f{i}").encode())) != port:
        i += 1
    return f"f{i}"


async def _listen(url: str, token: str, game_id: str, probe: Probe, ready: asyncio.Event) -> None:
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(
            json.dumps(
                {
                    "action": "subscribe",
                    "token": token,
                    "watchVersion": 1,
                    "wantsPresence": False,
                    "games": [{"meta": "failover", "id": game_id}],
                    "since": {},
                }
            )
        )
        # A barrier: the snapshot answers after the subscribe was handled.
        await ws.send(json.dumps({"action": "syncPresence"}))
        async for raw in ws:
            message = json.loads(raw)
            if message.get("verb") == "game" and "offset" in message:
                probe.received.setdefault(message["payload"]["eid"], time.monotonic())
                probe.offsets.append(message["offset"])
            ready.set()


async def measure(
    cluster: RedisCluster,
    nodes: list[Proc],
    jwt_secret: str,
    publish_secret: str,
    *,
    before: float = 2.0,
    after: float = 8.0,
    interval: float = 0.02,
) -> dict[str, Any]:
    victim = cluster.primaries()[0]
    game_id = game_on(cluster, victim)
    probes = [Probe(node.name) for node in nodes]
    listeners = []
    for node, probe in zip(nodes, probes, strict=True):
        ready = asyncio.Event()
        url = f"ws://{HOST}:{node.ws_port}/"
        token = mint_token(jwt_secret, f"probe-{node.name}")
        listeners.append(asyncio.create_task(_listen(url, token, game_id, probe, ready)))
        await asyncio.wait_for(ready.wait(), 10)
    await asyncio.sleep(0.5)  # the nodes' SSUBSCRIBEs land
    connections = [
        HttpConnection(HOST, n.http_port, {"Authorization": f"Bearer {publish_secret}"})
        for n in nodes
    ]
    accepted: dict[str, float] = {}
    failed = 0
    stop = asyncio.Event()

    async def publish() -> None:
        nonlocal failed
        i = 0
        while not stop.is_set():
            eid = f"e{i}"
            body = {"verb": "game", "payload": {"meta": "failover", "id": game_id, "eid": eid}}
            sent = time.monotonic()
            try:
                status, _ = await connections[i % len(connections)].request(
                    "POST", "/publish", json.dumps(body).encode()
                )
            except Exception:
                status = 0
            if status == 202:
                accepted[eid] = sent
            else:
                failed += 1
            i += 1
            await asyncio.sleep(interval)

    publisher = asyncio.create_task(publish())
    try:
        await asyncio.sleep(before)
        killed_at = time.monotonic()
        cluster.instance(victim).kill()
        await asyncio.sleep(after)
        stop.set()
        await publisher
        await asyncio.sleep(2.0)  # let the last events arrive
    finally:
        stop.set()
        for task in [publisher, *listeners]:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for connection in connections:
            connection.close()
    resumed: list[float] = []
    for probe in probes:
        after_kill = [
            t for eid, t in probe.received.items() if accepted.get(eid, killed_at) > killed_at
        ]
        resumed.append(min(after_kill) - killed_at if after_kill else float("nan"))
    lost = sum(1 for probe in probes for eid in accepted if eid not in probe.received)
    gaps = sum(
        1
        for probe in probes
        for a, b in zip(probe.offsets, probe.offsets[1:], strict=False)
        if b > a + 1
    )
    slowest_publish = max(
        (
            probe.received.get(eid, sent) - sent
            for eid, sent in accepted.items()
            for probe in probes
        ),
        default=float("nan"),
    )
    return {
        "victim_port": victim,
        "game": game_id,
        "probes": len(probes),
        "accepted": len(accepted),
        "publish_failures": failed,
        "resumed_after_s": round(max(resumed), 3),
        "resumed_after_per_probe_s": [round(r, 3) for r in resumed],
        "lost": lost,
        "offset_gaps": gaps,
        "slowest_publish_to_receive_s": round(slowest_publish, 3),
    }
