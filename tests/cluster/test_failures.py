"""Failures: a node killed, the presence writer killed, Redis restarted, a node paused.

Each test watches through clients that follow the browser's presence rules and
stay connected to surviving nodes; through every failure they must see what a
single node would show them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import signal
import time
from typing import Any

from tests.client import Client
from tests.cluster.harness import (
    CLEAN_STOP_BOUND,
    DEATH_BOUND,
    DEBOUNCE_MS,
    LEASE_MS,
    SLACK,
    Cluster,
    wait_visible,
)
from tests.waiting import eventually_read

NODES = ("n1", "n2", "n3")


def deltas(client: Client) -> list[dict[str, Any]]:
    return [m["payload"] for m in client.of_verb("connections") if m["payload"]["type"] == "delta"]


def assert_gap_free(client: Client) -> None:
    state = client.presence
    assert state.gaps == 0, f"{state.gaps} gaps"
    assert state.deltas == list(range(state.deltas[0], state.deltas[0] + len(state.deltas)))


def still_open(client: Client) -> bool:
    return client.ws.close_code is None


async def test_kill_9_of_a_node_withdraws_its_users_within_the_bound(cluster: Cluster) -> None:
    leader = await cluster.wait_leader()
    victim, *survivors = sorted(NODES, key=lambda n: n == leader)  # never the leader here
    observers = [await cluster.client(name, f"obs-{name}") for name in survivors]
    await cluster.client(victim, "alice")
    await cluster.client(victim, "bob")
    await cluster.client(survivors[0], "bob")  # bob has a tab on a survivor too
    expected = {f"obs-{name}" for name in survivors} | {"alice", "bob"}
    for observer in observers:
        await wait_visible(observer, expected, 5 + SLACK, "everyone's join")
    await eventually_read(
        cluster.rows,
        lambda rows: {r.endpoint for r in rows} == {*survivors, victim},
        5 + SLACK,
        "every node's rows",
    )

    cluster.kill(victim)
    killed_at = time.monotonic()
    expected.discard("alice")
    for observer in observers:
        await wait_visible(observer, expected, DEATH_BOUND + SLACK, "alice's leave")
    elapsed = time.monotonic() - killed_at
    # A figure, not a verdict: the deadline above is the hang guard.
    print(f"kill -9 of {victim}: leaves seen {elapsed:.2f}s later (bound {DEATH_BOUND:.1f}s)")

    for observer in observers:
        assert all("bob" not in d["leaves"] for d in deltas(observer))
        assert observer.presence.total_count == len(expected)
        assert_gap_free(observer)
    # The dead node's rows are deleted by the writer.
    await eventually_read(
        cluster.rows,
        lambda rows: victim not in {r.endpoint for r in rows},
        5 + SLACK,
        "the dead node's rows deleted",
    )


async def test_leader_failover_keeps_seq_gap_free(cluster: Cluster) -> None:
    leader = await cluster.wait_leader()
    others = [name for name in NODES if name != leader]
    observer = await cluster.client(others[0], "observer")
    await cluster.client(leader, "on-leader")
    await wait_visible(observer, {"observer", "on-leader"}, 5 + SLACK, "joins")
    seq_before = observer.presence.seq
    assert seq_before is not None

    # Churn on every node, and kill the writer in the middle of it.
    rng = random.Random(7)
    online: dict[str, Client] = {}
    stop = asyncio.Event()

    async def churn(nodes: list[str]) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            user = f"churn{rng.randrange(12)}"
            if user in online:
                await online.pop(user).close()
            else:
                name = rng.choice([n for n in nodes if cluster.nodes[n].alive])
                with contextlib.suppress(OSError, TimeoutError):
                    online[user] = await cluster.client(name, user)
            await asyncio.sleep(rng.uniform(0.02, DEBOUNCE_MS / 1000))

    task = asyncio.create_task(churn(others))
    await asyncio.sleep(1.5)
    cluster.kill(leader)
    killed_at = time.monotonic()
    new_leader = await cluster.wait_leader(LEASE_MS / 1000 + 2 + SLACK, other_than=leader)
    took_over = time.monotonic() - killed_at
    await asyncio.sleep(2.0)
    stop.set()
    await task

    expected = {"observer"} | set(online)
    await wait_visible(observer, expected, DEATH_BOUND + 2 * SLACK, "the state after failover")
    left_at = time.monotonic() - killed_at
    print(
        f"leader {leader} killed: {new_leader} took over after {took_over:.2f}s; "
        f"state correct after {left_at:.2f}s; seq {seq_before} -> {observer.presence.seq}"
    )
    assert still_open(observer)
    assert observer.presence.snapshots == 1, "the client never needed a resync"
    assert_gap_free(observer)
    assert observer.presence.seq is not None and observer.presence.seq > seq_before
    assert observer.presence.total_count == len(expected)
    assert any("on-leader" in d["leaves"] for d in deltas(observer))
    assert await cluster.presence_seq() >= observer.presence.seq


async def test_redis_restart_mid_test(cluster: Cluster) -> None:
    clients = {
        name: await cluster.client(name, f"u-{name}", games=[("chess", "g1")]) for name in NODES
    }
    leaving = await cluster.client("n3", "left-while-down")
    expected = {f"u-{name}" for name in NODES} | {"left-while-down"}
    for client in clients.values():
        await wait_visible(client, expected, 5 + SLACK, "joins")
    snapshots = {name: c.presence.snapshots for name, c in clients.items()}

    cluster.redis.stop()
    for name in NODES:
        await eventually_read(
            functools.partial(cluster.readyz, name), lambda status: status == 503, 10, "readyz 503"
        )
    # Local delivery goes on: an event published on n1 reaches n1's watcher.
    body = {"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": "while-down"}}
    assert await cluster.publish("n1", body) == 202
    await clients["n1"].next_message(lambda m: m["payload"].get("n") == "while-down")
    # Users who come and go while Redis is down are not lost.
    late = await cluster.client("n2", "joined-while-down")
    await leaving.close()
    await asyncio.sleep(1.0)  # an outage longer than the reconnect backoff

    cluster.redis.start()
    restarted_at = time.monotonic()
    for name in NODES:
        await cluster.wait_ready(name, within=10)
    ready_after = time.monotonic() - restarted_at
    expected.add("joined-while-down")
    expected.discard("left-while-down")
    for name, client in clients.items():
        # A fresh snapshot replaced the state, then deltas went on from it.
        await client.wait_for(lambda: client.presence.snapshots > snapshots[name], 5 + SLACK)  # noqa: B023
        await wait_visible(client, expected, 5 + SLACK, "presence after the restart")
        assert still_open(client)
        assert client.presence.total_count == len(expected)
    print(f"Redis restart: nodes ready {ready_after:.2f}s after it came back")

    # Events published after the reconnect reach every node.
    for source in NODES:
        marker = f"after-{source}"
        body = {"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": marker}}
        assert await cluster.publish(source, body) == 202
        for client in clients.values():
            await client.next_message(lambda m: m["payload"].get("n") == marker)  # noqa: B023
    # And presence goes on as one stream.
    await late.close()
    expected.discard("joined-while-down")
    await cluster.client("n3", "after-restart")
    expected.add("after-restart")
    for client in clients.values():
        await wait_visible(client, expected, 5 + SLACK, "presence after the restart")
        assert client.presence.total_count == len(expected)
        # The snapshot came before any delta of the new state: nothing to repair.
        assert client.presence.gaps == 0


CLEAN_STOP_NODE_TIMEOUT_MS = 600_000
"""Heartbeat timeout for the clean-stop test: ten minutes, far past its deadline."""


async def test_a_clean_stop_withdraws_users_at_once(pair: Cluster) -> None:
    # A clean stop drains (users who do not come back leave after the move
    # grace), and does not wait for the heartbeat timeout: with a timeout of ten
    # minutes, only the node's own goodbye can withdraw alice within the deadline.
    await pair.start("n1", "n2", node_timeout_ms=CLEAN_STOP_NODE_TIMEOUT_MS)
    observer = await pair.client("n1", "observer")
    await pair.client("n2", "alice")
    await wait_visible(observer, {"observer", "alice"}, 5 + SLACK, "alice's join")
    await pair.terminate("n2")
    assert CLEAN_STOP_BOUND + SLACK < CLEAN_STOP_NODE_TIMEOUT_MS / 1000
    await wait_visible(observer, {"observer"}, CLEAN_STOP_BOUND + SLACK, "alice's leave")
    assert_gap_free(observer)
    assert "n2" not in {r.endpoint for r in await pair.rows()}


async def test_a_paused_node_comes_back(cluster: Cluster) -> None:
    leader = await cluster.wait_leader()
    paused = next(name for name in NODES if name != leader)
    awake = next(name for name in NODES if name not in (leader, paused))
    observer = await cluster.client(awake, "observer")
    await cluster.client(paused, "alice")
    await wait_visible(observer, {"observer", "alice"}, 5 + SLACK, "alice's join")

    os.kill(cluster.nodes[paused].process.pid, signal.SIGSTOP)
    try:
        await wait_visible(observer, {"observer"}, DEATH_BOUND + SLACK, "alice withdrawn")
        await eventually_read(
            cluster.rows,
            lambda rows: paused not in {r.endpoint for r in rows},
            5 + SLACK,
            "the paused node's rows deleted",
        )
    finally:
        os.kill(cluster.nodes[paused].process.pid, signal.SIGCONT)
    # Its clients never left: it registers again, and its rows are written again.
    await wait_visible(observer, {"observer", "alice"}, 5 + SLACK, "alice back")
    await eventually_read(
        cluster.rows,
        lambda rows: paused in {r.endpoint for r in rows},
        5 + SLACK,
        "the paused node's rows written again",
    )
    assert_gap_free(observer)
