"""Chat over the WebSocket on the embedded default (memory store, in-process bus)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from protocol.chat import comment_weight
from protocol.errors import MAX_FRAME_BYTES
from server.store.memory import MemoryStore
from tests.chat_helpers import chat_message, post, replies, seed_game
from tests.client import Client
from tests.conftest import RunningServer
from tests.rows import Rows
from tests.waiting import eventually

GAME = ("chess", "g1")


def rows_of(server: RunningServer) -> Rows:
    assert isinstance(server.node.store, MemoryStore)
    return Rows(server.node.store)


def stored(server: RunningServer, game_id: str = "g1") -> list[dict[str, Any]]:
    row = rows_of(server).get("GAMECOMMENTS", game_id)
    return [] if row is None else list(row["comments"])


async def test_a_player_comment_is_stored_acked_and_fanned_out(server: RunningServer) -> None:
    seed_game(rows_of(server), GAME, ["alice", "bob"])
    author = await server.subscribed("alice", games=[GAME])
    other_tab = await server.subscribed("alice", games=[GAME])
    watcher = await server.subscribed("bob", games=[GAME])
    outsider = await server.subscribed("carol", games=[("chess", "g2")])

    ack = await post(author, GAME, "hello ✓ 🎉", msg_id="m-1", move=7)
    assert ack["verb"] == "chatAck"
    time_stamp = ack["payload"]["timeStamp"]
    assert ack["payload"] == {"clientMsgId": "m-1", "timeStamp": time_stamp}
    assert stored(server) == [
        {"comment": "hello ✓ 🎉", "userId": "alice", "moveNumber": 7, "timeStamp": time_stamp}
    ]

    expected_chat = {
        "meta": "chess",
        "id": "g1",
        "comment": "hello ✓ 🎉",
        "userId": "alice",
        "moveNumber": 7,
        "timeStamp": time_stamp,
        "clientMsgId": "m-1",
    }
    positions = set()
    for client in (author, other_tab, watcher):
        event = await client.next_message(lambda m: m["verb"] == "chat")
        assert event["payload"] == expected_chat
        positions.add((event["stream"], event["epoch"], event["offset"]))
    assert len(positions) == 1  # one event, one place on the game's stream
    assert next(iter(positions))[0] == "game:chess#g1"
    await watcher.next_message(lambda m: m["verb"] == "game")
    await server.publish({"verb": "test", "payload": "barrier"})
    for client in (author, other_tab, watcher, outsider):
        await client.next_message(lambda m: m["verb"] == "test")
    # today's refetch hint goes to everyone but the author, on any tab
    assert [m["payload"] for m in watcher.of_verb("game")] == [{"meta": "chess", "id": "g1"}]
    assert author.of_verb("game") == [] and other_tab.of_verb("game") == []
    assert outsider.of_verb("chat") == [] and outsider.of_verb("game") == []


async def test_a_retried_client_msg_id_is_stored_once(server: RunningServer) -> None:
    seed_game(rows_of(server), GAME, ["alice", "bob"])
    author = await server.subscribed("alice", games=[GAME])
    first = await post(author, GAME, "only once", msg_id="retry-1")
    again = await post(author, GAME, "only once", msg_id="retry-1")
    assert first["verb"] == again["verb"] == "chatAck"
    assert again["payload"]["timeStamp"] == first["payload"]["timeStamp"]
    assert [c["comment"] for c in stored(server)] == ["only once"]
    await author.barrier()
    assert len(author.of_verb("chat")) == 1
    # the same id from another author is another comment
    bob = await server.subscribed("bob")
    assert (await post(bob, GAME, "mine", msg_id="retry-1"))["verb"] == "chatAck"
    assert len(stored(server)) == 2


async def test_authorization_follows_the_game_row(server: RunningServer) -> None:
    rows = rows_of(server)
    seed_game(rows, GAME, ["alice", "bob"])
    seed_game(rows, ("chess", "done"), ["alice", "bob"], completed=True)
    rows.put("USER", "root", {"admin": True})
    rows.put("USER", "carol", {"admin": False})
    carol = await server.subscribed("carol")
    root = await server.subscribed("root")
    alice = await server.subscribed("alice")

    refused = await post(carol, GAME, "let me in", msg_id="c-1")
    assert refused["verb"] == "error"
    assert refused["payload"]["code"] == "not_allowed"
    assert refused["payload"]["clientMsgId"] == "c-1"
    assert (await post(root, GAME, "admin here"))["verb"] == "chatAck"

    done = await post(alice, ("chess", "done"), "gg", msg_id="a-1")
    assert done["payload"]["code"] == "game_completed"
    unknown = await post(alice, ("chess", "nope"), "hi", msg_id="a-2")
    assert unknown["payload"]["code"] == "game_not_found"
    assert [(c["userId"], c["comment"]) for c in stored(server)] == [("root", "admin here")]
    assert stored(server, "done") == [] and stored(server, "nope") == []


async def test_a_full_item_is_refused_and_unchanged(server: RunningServer) -> None:
    rows = rows_of(server)
    seed_game(rows, GAME, ["alice"])
    legacy = [{"comment": "x", "userId": "u", "moveNumber": 1, "timeStamp": 1}] * 3240
    rows.put("GAMECOMMENTS", "g1", {"comments": legacy})
    alice = await server.subscribed("alice", games=[GAME])
    full = await post(alice, GAME, "y" * 250, msg_id="big")
    assert full["verb"] == "error"
    assert full["payload"]["code"] == "comments_full" and full["payload"]["clientMsgId"] == "big"
    assert rows.get("GAMECOMMENTS", "g1") == {"comments": legacy}
    assert (await post(alice, GAME, "z" * 249))["verb"] == "chatAck"
    row = rows.get("GAMECOMMENTS", "g1")
    assert row is not None and row["commentBytes"] == 3240 * comment_weight("x") + 359
    await alice.barrier()
    assert len(alice.of_verb("chat")) == 1  # nothing announced for the refused one


@pytest.mark.parametrize("server", [{"chat_rate": 3}], indirect=True)
async def test_over_the_chat_rate_is_refused_and_nothing_stored(server: RunningServer) -> None:
    seed_game(rows_of(server), GAME, ["alice"])
    alice = await server.subscribed("alice")
    other_tab = await server.subscribed("alice")
    for i in range(3):
        assert (await post(alice, GAME, f"c{i}"))["verb"] == "chatAck"
    limited = await post(other_tab, GAME, "one too many", msg_id="over")
    assert limited["verb"] == "error"
    assert limited["payload"]["code"] == "rate_limited"
    assert limited["payload"]["clientMsgId"] == "over"
    assert [c["comment"] for c in stored(server)] == ["c0", "c1", "c2"]


async def bad(client: Client, message: dict[str, Any] | str) -> dict[str, Any]:
    count = len(client.of_verb("error"))
    await client.ws.send(
        message if isinstance(message, str) else json.dumps(message, ensure_ascii=False)
    )
    await client.wait_for(lambda: len(client.of_verb("error")) > count)
    payload: dict[str, Any] = client.of_verb("error")[-1]["payload"]
    return payload


async def test_bad_chat_input_gets_clear_errors_and_the_connection_stays(
    server: RunningServer,
) -> None:
    seed_game(rows_of(server), GAME, ["alice"])
    alice = await server.subscribed("alice")
    good = chat_message(GAME, "fine", msg_id="id-1")

    for field in ("meta", "id", "comment", "moveNumber"):
        missing = {k: v for k, v in good.items() if k != field}
        error = await bad(alice, missing)
        assert error["code"] == "invalid_message", field
        assert error["clientMsgId"] == "id-1"
    no_id = await bad(alice, {k: v for k, v in good.items() if k != "clientMsgId"})
    assert no_id["code"] == "invalid_message" and "clientMsgId" not in no_id

    for move in (3.5, "3", True, -1, None):
        error = await bad(alice, {**good, "moveNumber": move})
        assert error == {
            "code": "invalid_message",
            "message": "'moveNumber' must be a whole number, 0 or more",
            "clientMsgId": "id-1",
        }

    # The largest comment a 64 KiB frame can carry.
    frame_without = len(json.dumps({**good, "comment": ""}))
    huge = await bad(
        alice, json.dumps({**good, "comment": "x" * (MAX_FRAME_BYTES - frame_without)})
    )
    assert huge["code"] == "comment_too_long" and huge["clientMsgId"] == "id-1"
    assert (await bad(alice, {**good, "comment": "é" * 16_001}))["code"] == "comment_too_long"

    lone = json.dumps(good).replace('"fine"', '"bad \\ud800 surrogate"')
    error = await bad(alice, lone)
    assert error["code"] == "invalid_message" and "unicode" in error["message"]
    assert error["clientMsgId"] == "id-1"

    for blank in ("", "   \n\t "):
        error = await bad(alice, {**good, "comment": blank})
        assert error["code"] == "comment_empty" and error["clientMsgId"] == "id-1"

    assert (await bad(alice, {**good, "meta": "ch#ess"}))["code"] == "invalid_message"
    assert stored(server) == []
    assert (await post(alice, GAME, "still here"))["verb"] == "chatAck"  # connection stays


async def test_comments_are_cut_at_4000_utf16_units(server: RunningServer) -> None:
    seed_game(rows_of(server), GAME, ["alice"])
    alice = await server.subscribed("alice")
    # 3999 units, then an emoji (2 units) that would straddle the cut: it is dropped whole
    assert (await post(alice, GAME, "a" * 3999 + "🎉" + "b" * 100))["verb"] == "chatAck"
    assert (await post(alice, GAME, "c" * 5000))["verb"] == "chatAck"
    assert [len(c["comment"]) for c in stored(server)] == [3999, 4000]


async def test_chat_before_subscribe_is_refused(server: RunningServer) -> None:
    client = await server.client()
    error = await bad(client, chat_message(GAME, "hi"))
    assert error["code"] == "not_subscribed"


async def test_concurrent_posts_are_stored_once_each_in_event_order(server: RunningServer) -> None:
    players = [f"p{i}" for i in range(10)]
    seed_game(rows_of(server), GAME, players)
    watcher = await server.subscribed("watcher", games=[GAME])
    clients = [await server.subscribed(p) for p in players]

    async def burst(client: Client, player: str) -> None:
        for i in range(4):
            await client.send(chat_message(GAME, f"{player}-{i}", msg_id=f"{player}-{i}"))

    await asyncio.gather(*(burst(c, p) for c, p in zip(clients, players, strict=True)))
    for client, player in zip(clients, players, strict=True):
        ids = [f"{player}-{i}" for i in range(4)]

        def answered(client: Client = client, ids: list[str] = ids) -> bool:
            return all(replies(client, m) for m in ids)

        await client.wait_for(answered)
        assert all(replies(client, m)[0]["verb"] == "chatAck" for m in ids)
    await watcher.wait_for(lambda: len(watcher.of_verb("chat")) == 40)
    comments = [c["comment"] for c in stored(server)]
    assert sorted(comments) == sorted(f"{p}-{i}" for p in players for i in range(4))
    events = watcher.of_verb("chat")
    assert [m["payload"]["comment"] for m in events] == comments
    by_offset = sorted(events, key=lambda m: m["offset"])
    assert [m["payload"]["comment"] for m in by_offset] == comments
    assert all(m["stream"] == "game:chess#g1" for m in events)


@pytest.mark.parametrize("reached_redis", [False, True], ids=["lost", "answer-lost"])
async def test_a_failed_append_of_the_events_is_retried_and_appended_once(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, reached_redis: bool
) -> None:
    """The comment is stored and acked before its events are appended: a failed
    append must not leave watchers without them, nor give them two."""
    seed_game(rows_of(server), GAME, ["alice", "bob"])
    watcher = await server.subscribed("bob", games=[GAME])
    author = await server.subscribed("alice")
    streams = server.node.streams
    append_many = streams.append_many
    failures: list[Any] = []

    async def failing_once(items: Any) -> Any:
        if not failures:
            failures.append(items)
            if reached_redis:
                await append_many(items)  # it ran; only its answer is lost
            raise ConnectionError("connection reset")
        return await append_many(items)

    monkeypatch.setattr(streams, "append_many", failing_once)
    assert (await post(author, GAME, "hello", msg_id="m-1"))["verb"] == "chatAck"
    metrics = server.node.metrics
    await eventually(lambda: metrics.value("ap_chat_publish_retries_total") == 1, 10, "a retry")
    await watcher.wait_for(lambda: len(watcher.of_verb("chat")) == 1)
    await server.publish({"verb": "test", "payload": "barrier"})
    await watcher.next_message(lambda m: m["verb"] == "test")
    assert failures, "the first append did not fail"
    assert [m["payload"]["comment"] for m in watcher.of_verb("chat")] == ["hello"]
    assert len(watcher.of_verb("game")) == 1
    assert watcher.of_verb("chat")[0]["offset"] == 1
    assert [c["comment"] for c in stored(server)] == ["hello"]
    assert metrics.value("ap_chat_unannounced_total") == 0


async def test_dashboard_marks_are_written_behind(server: RunningServer) -> None:
    rows = rows_of(server)
    seed_game(rows, GAME, ["alice", "bob"])
    for player in ("alice", "bob"):
        rows.put(f"CURRENTGAMES#{player}", "g1", {"id": "g1"})
    rows.put("GAMEWATCHERS#g1", "spec")
    rows.put("WATCHED#spec", "g1", {"addedAt": 5})
    alice = await server.subscribed("alice")
    ack = await post(alice, GAME, "mark me")
    ts = ack["payload"]["timeStamp"]
    await server.node.chat_marks.drained()
    assert rows.get("USERGAME#alice", "g1") == {"lastChat": ts, "seen": ts + 10}
    assert rows.get("USERGAME#bob", "g1") == {"lastChat": ts}
    assert rows.get("WATCHED#spec", "g1") == {"addedAt": 5, "lastChat": ts}


async def test_last_seen_is_written_once_per_quarter_hour(server: RunningServer) -> None:
    rows = rows_of(server)
    rows.put("USERS", "alice", {"name": "Alice"})
    alice = await server.subscribed("alice")
    await server.node.last_seen.drained()
    row = rows.get("USERS", "alice")
    assert row is not None and isinstance(row.get("lastSeen"), int)
    # Even with the stored value made stale behind the node's back, a syncPresence
    # and more tabs write nothing more within the 15 minutes.
    rows.put("USERS", "alice", {"name": "Alice", "lastSeen": 1})
    await alice.sync_presence()
    for _ in range(3):
        await server.subscribed("alice")
    await server.node.last_seen.drained()
    assert rows.get("USERS", "alice") == {"name": "Alice", "lastSeen": 1}
