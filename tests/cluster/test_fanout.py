"""Game events and admin broadcasts cross the cluster: three nodes act like one."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.client import Client
from tests.cluster.harness import Cluster


def game(meta: str, game_id: str, *, verb: str = "game", exclude: list[str] | None = None) -> Any:
    body: dict[str, Any] = {"verb": verb, "payload": {"meta": meta, "id": game_id}}
    if exclude:
        body["exclude"] = exclude
    return body


def got_game(client: Client, meta: str, game_id: str, verb: str = "game") -> int:
    return sum(
        1
        for m in client.of_verb(verb)
        if m["payload"].get("meta") == meta and m["payload"].get("id") == game_id
    )


async def barrier(cluster: Cluster, clients: list[Client], marker: str) -> None:
    """Publish an admin broadcast after what is under test and wait until all have it.

    Each node receives the publisher's messages in order, so a client holding the
    marker would already hold any earlier event meant for it.
    """
    assert await cluster.publish("n1", {"verb": "test", "payload": marker}) == 202
    for client in clients:
        await client.next_message(lambda m: m.get("payload") == marker)


async def test_an_event_published_on_one_node_reaches_watchers_on_every_node(
    cluster: Cluster,
) -> None:
    watchers = [
        await cluster.client(name, f"w-{name}", games=[("chess", "g1")])
        for name in ("n1", "n2", "n3")
    ]
    legacy = await cluster.client("n3", "legacy", watch_version=None)
    other = await cluster.client("n2", "other", games=[("chess", "g2")])
    excluded = await cluster.client("n2", "mover", games=[("chess", "g1")])
    everyone = [*watchers, legacy, other, excluded]

    for source in ("n1", "n2", "n3"):
        await cluster.publish(source, game("chess", "g1", exclude=["mover"]))
    await cluster.publish("n3", game("chess", "g1", verb="chat"))
    await barrier(cluster, everyone, "after-g1")

    for client in [*watchers, legacy]:
        assert got_game(client, "chess", "g1") == 3
        assert got_game(client, "chess", "g1", "chat") == 1
    assert got_game(other, "chess", "g1") == 0
    assert got_game(excluded, "chess", "g1") == 0
    assert got_game(excluded, "chess", "g1", "chat") == 1  # the chat excluded nobody
    for client in everyone:
        assert [m["payload"] for m in client.of_verb("test")] == ["after-g1"]


async def test_watching_a_new_game_subscribes_its_node(cluster: Cluster) -> None:
    client = await cluster.client("n2", "alice", games=[("chess", "g1")])
    await client.watch([("go", "g9")])
    # The node subscribes to the game's channel in the background: publish until it lands.
    deadline = time.monotonic() + 5
    while got_game(client, "go", "g9") == 0:
        assert time.monotonic() < deadline, "the new watch never took effect on n2"
        assert await cluster.publish("n3", game("go", "g9")) == 202
        await asyncio.sleep(0.1)
    await client.watch([])
    await asyncio.sleep(0.3)
    before = got_game(client, "go", "g9")
    await cluster.publish("n1", game("go", "g9"))
    await barrier(cluster, [client], "after-unwatch")
    assert got_game(client, "go", "g9") == before
