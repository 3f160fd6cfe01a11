"""Connection lifecycle over real sockets: subscribe, watchGames, syncPresence, rows, keepalive."""

from __future__ import annotations

import asyncio
import time

import pytest

from server.store.base import CONNECTION_TTL_SECONDS, ConnectionRecord
from tests.client import dev_token
from tests.conftest import RunningServer


async def rows_of(server: RunningServer, user_id: str) -> list[ConnectionRecord]:
    await server.node.registry.drained()
    return [r for r in await server.node.store.list_connections() if r.user_id == user_id]


async def test_subscribe_stores_the_row_sends_a_snapshot_and_counts_the_user(
    server: RunningServer,
) -> None:
    alice = await server.client()
    before = time.time()
    await alice.subscribe("alice", games=[("chess", "g1"), ("go", "g2")])
    snapshot = alice.of_verb("connections")[0]["payload"]
    assert snapshot["type"] == "snapshot"
    [row] = await rows_of(server, "alice")
    assert row.endpoint == "test-node"
    assert row.invisible is False and row.wants_presence is True
    assert row.watch_version == 1
    assert row.watching_games == frozenset({"chess#g1", "go#g2"})
    assert before + CONNECTION_TTL_SECONDS - 1 <= row.ttl <= time.time() + CONNECTION_TTL_SECONDS
    await alice.wait_for(lambda: alice.presence.visible == {"alice"})
    assert alice.presence.total_count == 1


async def test_watch_games_replaces_the_set_and_refreshes_the_row(server: RunningServer) -> None:
    alice = await server.subscribed("alice", games=[("chess", "g1")], watch_version=None)
    [row] = await rows_of(server, "alice")
    assert row.watch_version is None
    old_ttl = row.ttl
    await asyncio.sleep(1.05)  # ttl has a resolution of one second
    await alice.watch([("go", "g2"), ("go", "g3")])
    await alice.barrier()
    [row] = await rows_of(server, "alice")
    assert row.watching_games == frozenset({"go#g2", "go#g3"})
    assert row.watch_version == 1
    assert row.ttl > old_ttl
    assert set(server.node.index.by_game) == {"go#g2", "go#g3"}
    await alice.watch([])
    await alice.barrier()
    [row] = await rows_of(server, "alice")
    assert row.watching_games == frozenset()
    assert server.node.index.by_game == {}


async def test_sync_presence_sends_a_fresh_snapshot(server: RunningServer) -> None:
    alice = await server.subscribed("alice")
    await alice.wait_for(lambda: alice.presence.visible == {"alice"})
    await server.subscribed("bob")
    await alice.wait_for(lambda: alice.presence.visible == {"alice", "bob"})
    await alice.sync_presence()
    snapshot = alice.of_verb("connections")[-1]["payload"]
    assert snapshot["type"] == "snapshot"
    assert sorted(snapshot["visibleUserIds"]) == ["alice", "bob"]
    assert snapshot["totalCount"] == 2
    assert snapshot["seq"] == alice.presence.seq


async def test_close_deletes_the_row_and_the_indexes(server: RunningServer) -> None:
    alice = await server.subscribed("alice", games=[("chess", "g1")])
    assert len(await rows_of(server, "alice")) == 1
    await alice.close()
    for _ in range(100):
        if not server.node.sessions:
            break
        await asyncio.sleep(0.02)
    assert await rows_of(server, "alice") == []
    assert server.node.index.by_game == {} and server.node.index.by_user == {}


@pytest.mark.parametrize("server", [{"ttl_refresh_seconds": 0.2}], indirect=True)
async def test_long_lived_connections_refresh_their_ttl(server: RunningServer) -> None:
    await server.subscribed("alice")
    [row] = await rows_of(server, "alice")
    first = row.ttl
    # With a refresh every 0.2 s, any row older than the horizon is pushed forward.
    await asyncio.sleep(1.5)
    [row] = await rows_of(server, "alice")
    assert row.ttl > first


FAST_KEEPALIVE = {"ping_interval": 0.2, "ping_timeout": 0.3, "close_timeout": 0.5}


@pytest.mark.parametrize("server", [FAST_KEEPALIVE], indirect=True)
async def test_keepalive_drops_a_dead_peer(server: RunningServer) -> None:
    watcher = await server.subscribed("watcher")
    ghost = await server.subscribed("ghost")
    await watcher.wait_for(lambda: "ghost" in watcher.presence.visible)
    # The peer stops reading: pongs stop, as with a vanished laptop.
    transport = ghost.ws.transport
    assert transport is not None
    transport.pause_reading()
    await watcher.wait_for(lambda: "ghost" not in watcher.presence.visible, within=5)
    assert "ghost" not in server.node.index.by_user
    assert await rows_of(server, "ghost") == []
    transport.resume_reading()


async def test_wants_presence_false_gets_no_presence_frames(server: RunningServer) -> None:
    bot = await server.client()
    await bot.send(
        {
            "action": "subscribe",
            "token": dev_token("bot"),
            "wantsPresence": False,
            "watchVersion": 1,
            "games": [{"meta": "chess", "id": "g1"}],
        }
    )
    await server.subscribed("alice")
    await asyncio.sleep(0.4)  # two debounce windows: the join delta has gone out
    status, _ = await server.publish({"verb": "game", "payload": {"meta": "chess", "id": "g1"}})
    assert status == 202
    await bot.next_message(lambda m: m["verb"] == "game")
    assert bot.of_verb("connections") == []  # no snapshot on subscribe, no deltas
    [row] = await rows_of(server, "bot")
    assert row.wants_presence is False


async def test_msgpack_subprotocol_gets_binary_frames(server: RunningServer) -> None:
    client = await server.client(msgpack_protocol=True)
    assert client.ws.subprotocol == "ap.msgpack"
    await client.subscribe("packer", games=[("chess", "g1")])
    await client.wait_for(lambda: client.presence.visible == {"packer"})
    await server.publish({"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": 1}})
    event = await client.next_message(lambda m: m["verb"] == "game")
    assert event["payload"] == {"meta": "chess", "id": "g1", "n": 1}


async def test_browser_without_subprotocol_gets_json_text(server: RunningServer) -> None:
    client = await server.client()
    assert client.ws.subprotocol is None
    await client.subscribe("browser")
    raw = client.of_verb("connections")[0]
    assert raw["payload"]["type"] == "snapshot"


async def test_resubscribe_as_the_same_user_updates_flags(server: RunningServer) -> None:
    watcher = await server.subscribed("watcher")
    alice = await server.subscribed("alice")
    await watcher.wait_for(lambda: "alice" in watcher.presence.visible)
    await alice.subscribe("alice", invisible=True)
    await watcher.wait_for(lambda: "alice" not in watcher.presence.visible)
    # Still online, so still counted: the delta's totalCount says so.
    assert watcher.presence.server_total == 2
    [row] = await rows_of(server, "alice")
    assert row.invisible is True


async def test_resubscribe_as_another_user_is_refused(server: RunningServer) -> None:
    alice = await server.subscribed("alice")
    await alice.send({"action": "subscribe", "token": dev_token("eve")})
    error = await alice.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "user_mismatch"
    await alice.barrier()
    assert server.node.index.by_user.keys() == {"alice"}


@pytest.mark.parametrize("server", [FAST_KEEPALIVE], indirect=True)
async def test_keepalive_pings_a_live_peer_from_the_node_and_keeps_it(
    server: RunningServer,
) -> None:
    """One node-wide sweep pings every socket; websockets' task per socket is off."""
    alice = await server.subscribed("alice")
    (session,) = [s for s in server.node.sessions if s.user_id == "alice"]
    assert session.ws.keepalive_task is None  # the library pings nobody itself
    first_ping = session.pinged_at
    # Several intervals and timeouts: each ping answered by the client's library.
    await asyncio.sleep(2.0)
    assert session.pinged_at - first_ping > 0.2  # pinged more than once
    # Unanswered for 0.3 s, it would have been closed: the pongs came back.
    assert session.close_task is None and "alice" in server.node.index.by_user
    await alice.barrier()
