"""Streams end to end on the embedded default: positions, since/recovered, skip, user events."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from protocol.envelope import encode_envelope, encode_positioned
from protocol.errors import CloseCode
from protocol.messages import Broadcast, Position
from protocol.parse import parse_broadcast
from server.routing import recovery as recovery_module
from tests.client import Client
from tests.conftest import RunningServer

CHESS = "game:chess#g1"


def move(n: int, *, game: str = "g1", verb: str = "game", **extra: Any) -> dict[str, Any]:
    return {"verb": verb, "payload": {"meta": "chess", "id": game, "n": n}, **extra}


async def publish_moves(server: RunningServer, first: int, last: int, **extra: Any) -> str:
    """Publish moves ``first..last``; returns the stream's epoch."""
    epoch = ""
    for n in range(first, last + 1):
        status, reply = await server.publish(move(n, **extra))
        assert status == 202 and isinstance(reply, dict)
        position = reply["positions"][CHESS]
        assert position["offset"] == n
        epoch = position["epoch"]
    return epoch


def moves(client: Client, stream: str = CHESS) -> list[int]:
    return [m["payload"]["n"] for m in client.on_stream(stream) if m["verb"] == "game"]


async def test_events_carry_contiguous_positions(server: RunningServer) -> None:
    watcher = await server.subscribed("alice", games=[("chess", "g1")], since={})
    epoch = await publish_moves(server, 1, 5)
    await watcher.wait_for(lambda: len(watcher.on_stream(CHESS)) == 5)
    assert watcher.offsets(CHESS) == [1, 2, 3, 4, 5]
    assert {m["epoch"] for m in watcher.on_stream(CHESS)} == {epoch}


async def test_reconnect_with_since_gets_exactly_the_missed_events_then_live(
    server: RunningServer,
) -> None:
    first = await server.subscribed("alice", games=[("chess", "g1")], since={})
    epoch = await publish_moves(server, 1, 3)
    await first.wait_for(lambda: len(first.on_stream(CHESS)) == 3)
    await first.close()
    await publish_moves(server, 4, 7)

    again = await server.subscribed(
        "alice", games=[("chess", "g1")], since={CHESS: {"epoch": epoch, "offset": 3}}
    )
    answer = await again.wait_recovered(CHESS)
    assert answer == {"stream": CHESS, "recovered": True, "epoch": epoch, "offset": 7}
    assert again.offsets(CHESS) == [4, 5, 6, 7]
    assert moves(again) == [4, 5, 6, 7]
    # The replay comes before the answer, and live events follow with no gap.
    kinds = [
        m["verb"] for m in again.messages if m.get("stream") == CHESS or m["verb"] == "recovered"
    ]
    assert kinds == ["game"] * 4 + ["recovered"]
    await publish_moves(server, 8, 9)
    await again.wait_for(lambda: len(again.on_stream(CHESS)) == 6)
    assert again.offsets(CHESS) == [4, 5, 6, 7, 8, 9]


async def test_nothing_missed_is_recovered_with_no_events(server: RunningServer) -> None:
    epoch = await publish_moves(server, 1, 2)
    client = await server.subscribed(
        "alice", games=[("chess", "g1")], since={CHESS: {"epoch": epoch, "offset": 2}}
    )
    assert await client.wait_recovered(CHESS) == {
        "stream": CHESS,
        "recovered": True,
        "epoch": epoch,
        "offset": 2,
    }
    assert client.on_stream(CHESS) == []


async def test_a_stream_never_published_gives_an_epoch_to_hold(server: RunningServer) -> None:
    client = await server.subscribed(
        "alice", games=[("chess", "g1")], since={CHESS: {"epoch": "", "offset": 0}}
    )
    answer = await client.wait_recovered(CHESS)
    assert answer["recovered"] is False and answer["offset"] == 0 and answer["epoch"]
    # With that epoch, the client can later prove it missed nothing or get it all.
    await publish_moves(server, 1, 2)
    await client.close()
    again = await server.subscribed(
        "alice", games=[("chess", "g1")], since={CHESS: {"epoch": answer["epoch"], "offset": 0}}
    )
    assert (await again.wait_recovered(CHESS))["recovered"] is True
    assert again.offsets(CHESS) == [1, 2]


async def test_a_wrong_epoch_is_not_recovered_and_nothing_is_replayed(
    server: RunningServer,
) -> None:
    epoch = await publish_moves(server, 1, 4)
    client = await server.subscribed(
        "alice", games=[("chess", "g1")], since={CHESS: {"epoch": "old-epoch", "offset": 2}}
    )
    answer = await client.wait_recovered(CHESS)
    assert answer == {"stream": CHESS, "recovered": False, "epoch": epoch, "offset": 4}
    assert client.on_stream(CHESS) == []
    await publish_moves(server, 5, 5)
    await client.wait_for(lambda: client.offsets(CHESS) == [5])


async def test_a_client_ahead_of_the_stream_is_not_recovered(server: RunningServer) -> None:
    epoch = await publish_moves(server, 1, 2)
    client = await server.subscribed(
        "alice", games=[("chess", "g1")], since={CHESS: {"epoch": epoch, "offset": 9}}
    )
    assert (await client.wait_recovered(CHESS))["recovered"] is False


@pytest.mark.parametrize("server", [{"history_size": 3}], indirect=True)
async def test_history_past_its_size_is_not_recovered(server: RunningServer) -> None:
    epoch = await publish_moves(server, 1, 6)
    client = await server.subscribed(
        "alice", games=[("chess", "g1")], since={CHESS: {"epoch": epoch, "offset": 2}}
    )
    answer = await client.wait_recovered(CHESS)
    assert answer == {"stream": CHESS, "recovered": False, "epoch": epoch, "offset": 6}
    assert client.on_stream(CHESS) == [], "a partial replay is never sent"
    # Within the size it is exact.
    inside = await server.subscribed(
        "bob", games=[("chess", "g1")], since={CHESS: {"epoch": epoch, "offset": 3}}
    )
    assert (await inside.wait_recovered(CHESS))["recovered"] is True
    assert inside.offsets(CHESS) == [4, 5, 6]


@pytest.mark.parametrize("server", [{"history_ttl": 0.3}], indirect=True)
async def test_history_past_its_ttl_is_not_recovered(server: RunningServer) -> None:
    epoch = await publish_moves(server, 1, 3)
    await asyncio.sleep(0.5)  # at least that long: the history has expired
    client = await server.subscribed(
        "alice", games=[("chess", "g1")], since={CHESS: {"epoch": epoch, "offset": 1}}
    )
    answer = await client.wait_recovered(CHESS)
    # The epoch and top outlive the history: the client learns it must refetch.
    assert answer == {"stream": CHESS, "recovered": False, "epoch": epoch, "offset": 3}


async def test_watch_games_accepts_since(server: RunningServer) -> None:
    epoch = await publish_moves(server, 1, 3)
    client = await server.subscribed("alice", games=[])
    await client.watch([("chess", "g1")], since={CHESS: {"epoch": epoch, "offset": 1}})
    assert (await client.wait_recovered(CHESS))["recovered"] is True
    assert client.offsets(CHESS) == [2, 3]


async def test_a_stream_not_entitled_gets_an_error_and_the_rest_applies(
    server: RunningServer,
) -> None:
    epoch = await publish_moves(server, 1, 2)
    client = await server.subscribed(
        "alice",
        games=[("chess", "g1")],
        since={
            "game:go#g9": {"epoch": "x", "offset": 0},
            "user:bob": {"epoch": "x", "offset": 0},
            CHESS: {"epoch": epoch, "offset": 0},
        },
    )
    assert (await client.wait_recovered(CHESS))["recovered"] is True
    errors = [m["payload"]["code"] for m in client.of_verb("error")]
    assert errors == ["stream_not_allowed", "stream_not_allowed"]
    assert client.recovered("game:go#g9") == [] and client.recovered("user:bob") == []
    assert client.ws.close_code is None


@pytest.mark.parametrize(
    "since",
    [
        {CHESS: {"epoch": 5, "offset": 0}},
        {CHESS: {"epoch": "e", "offset": -1}},
        {CHESS: {"epoch": "e", "offset": 1.5}},
        {CHESS: {"epoch": "e", "offset": True}},
        {CHESS: {"epoch": "e"}},
        {CHESS: "e:1"},
        [CHESS],
        {f"game:chess#g{i}": {"epoch": "e", "offset": 0} for i in range(1001)},
    ],
)
async def test_a_malformed_since_fails_the_whole_action(server: RunningServer, since: Any) -> None:
    client = await server.subscribed("alice", games=[("go", "g2")])
    await client.watch([("chess", "g1")], since=since)
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "invalid_message"
    # None of it applied: the old watch set stands, and the connection stays.
    await publish_moves(server, 1, 1)
    await server.publish({"verb": "game", "payload": {"meta": "go", "id": "g2"}})
    await client.next_message(lambda m: m["verb"] == "game")
    await client.barrier()
    assert [m["payload"]["id"] for m in client.of_verb("game")] == ["g2"]
    assert client.of_verb("recovered") == []
    assert client.ws.close_code is None


async def test_a_malformed_since_on_subscribe_leaves_the_connection_unsubscribed(
    server: RunningServer,
) -> None:
    client = await server.client()
    from tests.client import dev_token

    await client.send(
        {"action": "subscribe", "token": dev_token("alice"), "since": {CHESS: {"offset": 0}}}
    )
    assert (await client.next_message(lambda m: m["verb"] == "error"))["payload"][
        "code"
    ] == "invalid_message"
    await client.send({"action": "syncPresence"})
    await client.wait_for(lambda: len(client.of_verb("error")) == 2)
    assert client.of_verb("error")[1]["payload"]["code"] == "not_subscribed"
    assert client.ws.close_code is None


async def test_excluded_stream_speakers_get_skip_and_plain_clients_nothing(
    server: RunningServer,
) -> None:
    speaker = await server.subscribed("mover", games=[("chess", "g1")], since={})
    plain = await server.subscribed("mover", games=[("chess", "g1")])
    other = await server.subscribed("opponent", games=[("chess", "g1")], since={})
    await publish_moves(server, 1, 1)
    epoch = await publish_moves(server, 2, 2, exclude=["mover"])
    await publish_moves(server, 3, 3)
    await speaker.wait_for(lambda: len(speaker.on_stream(CHESS)) == 3)
    assert speaker.on_stream(CHESS)[1] == {
        "verb": "skip",
        "stream": CHESS,
        "epoch": epoch,
        "offset": 2,
    }
    assert speaker.offsets(CHESS) == [1, 2, 3], "positions stay contiguous"
    await other.wait_for(lambda: moves(other) == [1, 2, 3])
    await plain.wait_for(lambda: len(plain.of_verb("game")) == 2)
    await plain.barrier()
    assert [m["payload"]["n"] for m in plain.of_verb("game")] == [1, 3]
    assert plain.of_verb("skip") == [] and plain.of_verb("recovered") == []


async def test_replay_has_skips_where_the_client_was_excluded(server: RunningServer) -> None:
    await publish_moves(server, 1, 1)
    await publish_moves(server, 2, 2, exclude=["mover"])
    epoch = await publish_moves(server, 3, 3)
    client = await server.subscribed(
        "mover", games=[("chess", "g1")], since={CHESS: {"epoch": epoch, "offset": 0}}
    )
    assert (await client.wait_recovered(CHESS))["recovered"] is True
    assert [m["verb"] for m in client.on_stream(CHESS)] == ["game", "skip", "game"]
    assert client.offsets(CHESS) == [1, 2, 3]


async def test_a_replay_shared_by_clients_from_one_position_keeps_each_ones_skips(
    server: RunningServer,
) -> None:
    # The first client's replay is kept whole for the next ones from the same
    # position: the excluded user must still get a skip, in either format, and
    # every frame of a shared replay counts as sent.
    await publish_moves(server, 1, 1)
    await publish_moves(server, 2, 2, exclude=["mover"])
    epoch = await publish_moves(server, 3, 3)
    since = {CHESS: {"epoch": epoch, "offset": 0}}
    sent_before = server.node.metrics.value("ap_frames_sent_total")
    clients: dict[tuple[str, bool], Client] = {}
    for user, binary in [("a", False), ("mover", False), ("b", True), ("mover", True)]:
        client = clients[(user, binary)] = await server.client(msgpack_protocol=binary)
        await client.subscribe(user, games=[("chess", "g1")], since=since, wants_presence=False)
        assert (await client.wait_recovered(CHESS)) == {
            "stream": CHESS,
            "recovered": True,
            "epoch": epoch,
            "offset": 3,
        }
        assert client.offsets(CHESS) == [1, 2, 3]
    verbs = {key: [m["verb"] for m in c.on_stream(CHESS)] for key, c in clients.items()}
    assert verbs == {
        ("a", False): ["game", "game", "game"],
        ("mover", False): ["game", "skip", "game"],
        ("b", True): ["game", "game", "game"],
        ("mover", True): ["game", "skip", "game"],
    }
    for client in clients.values():
        await client.barrier()
    sent = server.node.metrics.value("ap_frames_sent_total") - sent_before
    assert sent == sum(c.frames_received for c in clients.values())


async def test_the_replays_kept_are_bounded_in_frames(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recovery_module, "REPLAY_RUN_FRAMES", 5)
    epoch = await publish_moves(server, 1, 3)
    for after in (0, 1, 2):  # replays of 3, 2 and 1 events, each then recovered
        client = await server.subscribed(
            "alice", games=[("chess", "g1")], since={CHESS: {"epoch": epoch, "offset": after}}
        )
        assert (await client.wait_recovered(CHESS))["recovered"] is True
        assert client.offsets(CHESS) == list(range(after + 1, 4))
        await client.close()
    runs = server.node.recovery._replay_runs
    assert [run.frames.count for run in runs.values()] == [3, 2]  # the first one went


async def test_a_session_closing_before_its_recovery_is_answered_gets_no_answer_built(
    server: RunningServer,
) -> None:
    # A client that gave up (a reconnect storm's timeouts) costs no reads nor replay.
    epoch = await publish_moves(server, 1, 3)
    client = await server.subscribed("alice", games=[("chess", "g1")], since={})
    (session,) = [s for s in server.node.sessions if s.user_id == "alice"]
    answered = server.node.metrics.value("ap_stream_recoveries_total")
    reads = server.node.metrics.value("ap_stream_history_reads_total")
    session.close(CloseCode.GOING_AWAY, "gone")
    await server.node.recovery.recover(session, {CHESS: Position(epoch, 0)})
    assert session.recovering == {}
    assert server.node.metrics.value("ap_stream_recoveries_total") == answered
    assert server.node.metrics.value("ap_stream_history_reads_total") == reads
    assert (await client.closed())[0] == CloseCode.GOING_AWAY


# --- user events ----------------------------------------------------------------


def your_turn(*users: str, **extra: Any) -> dict[str, Any]:
    return {
        "verb": "yourTurn",
        "payload": {"meta": "chess", "id": "g1"},
        "users": list(users),
        **extra,
    }


async def test_a_user_event_reaches_every_tab_of_each_user_and_nobody_else(
    server: RunningServer,
) -> None:
    bot_tabs = [await server.subscribed("bot1") for _ in range(2)]
    human = await server.subscribed("human", since={})
    bystander = await server.subscribed("bystander", games=[("chess", "g1")])
    status, reply = await server.publish(your_turn("bot1", "human"))
    assert status == 202 and isinstance(reply, dict)
    positions = reply["positions"]
    assert set(positions) == {"user:bot1", "user:human"}
    assert all(p["offset"] == 1 for p in positions.values())
    for tab in bot_tabs:
        event = await tab.next_message(lambda m: m["verb"] == "yourTurn")
        assert event == {
            "verb": "yourTurn",
            "payload": {"meta": "chess", "id": "g1"},
            "stream": "user:bot1",
            "epoch": positions["user:bot1"]["epoch"],
            "offset": 1,
        }
    await human.next_message(lambda m: m["verb"] == "yourTurn")
    await bystander.barrier()
    assert bystander.of_verb("yourTurn") == []


@pytest.mark.parametrize("verb", ["yourTurn", "notification", "challenge", "gameStart", "gameEnd"])
async def test_every_user_verb_is_accepted(server: RunningServer, verb: str) -> None:
    user = await server.subscribed("u1")
    status, _ = await server.publish({"verb": verb, "payload": {"x": 1}, "users": ["u1"]})
    assert status == 202
    assert (await user.next_message(lambda m: m["verb"] == verb))["payload"] == {"x": 1}


async def test_exclude_applies_to_user_events(server: RunningServer) -> None:
    speaker = await server.subscribed("u1", since={})
    plain = await server.subscribed("u1")
    await server.publish(your_turn("u1", exclude=["u1"]))
    await server.publish(your_turn("u1"))
    await speaker.wait_for(lambda: len(speaker.on_stream("user:u1")) == 2)
    assert [m["verb"] for m in speaker.on_stream("user:u1")] == ["skip", "yourTurn"]
    await plain.next_message(lambda m: m["verb"] == "yourTurn")
    await plain.barrier()
    assert len(plain.of_verb("yourTurn")) == 1


async def test_a_user_stream_is_recovered_after_a_reconnect(server: RunningServer) -> None:
    first = await server.subscribed("u1", since={})
    _, reply = await server.publish(your_turn("u1"))
    assert isinstance(reply, dict)
    epoch = reply["positions"]["user:u1"]["epoch"]
    await first.next_message(lambda m: m["verb"] == "yourTurn")
    await first.close()
    await server.publish({"verb": "notification", "payload": {"n": 2}, "users": ["u1"]})
    await server.publish({"verb": "gameEnd", "payload": {"n": 3}, "users": ["u1"]})
    again = await server.subscribed("u1", since={"user:u1": {"epoch": epoch, "offset": 1}})
    assert (await again.wait_recovered("user:u1"))["recovered"] is True
    assert [m["verb"] for m in again.on_stream("user:u1")] == ["notification", "gameEnd"]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"verb": "yourTurn", "payload": {}, "users": [f"u{i}" for i in range(1001)]}, 400),
        ({"verb": "yourTurn", "payload": {}, "users": [f"u{i}" for i in range(1000)]}, 202),
        ({"verb": "game", "payload": {"meta": "m", "id": "g"}, "users": ["u1"]}, 400),
        ({"verb": "yourTurn", "payload": {}, "users": "u1"}, 400),
        ({"verb": "yourTurn", "payload": {}, "users": [1]}, 400),
        ({"verb": "yourTurn", "payload": {}, "users": []}, 400),
    ],
)
async def test_publish_to_users_validates(
    server: RunningServer, body: dict[str, Any], status: int
) -> None:
    got, reply = await server.publish(body)
    assert got == status, reply
    if status == 202:
        assert isinstance(reply, dict) and len(reply["positions"]) == 1000


async def test_an_append_answer_is_delivered_only_as_the_next_event_and_once(
    server: RunningServer,
) -> None:
    """A cluster node's own append may answer before the bus brings its copy, or
    before another node's earlier event. Played here by hand on the embedded node
    (whose bus has delivered by the time an append answers): the answer is
    delivered at once only as the stream's very next event, and the copy that
    follows is dropped."""
    watcher = await server.subscribed("alice", games=[("chess", "g1")], since={})
    plain = await server.subscribed("bob", games=[("chess", "g1")])
    epoch = await publish_moves(server, 1, 1)
    await watcher.wait_for(lambda: watcher.offsets(CHESS) == [1])
    delivery = server.node.delivery
    at_append = "ap_stream_delivered_at_append_total"

    def message(n: int) -> Broadcast:
        return parse_broadcast(json.dumps(move(n)))

    def from_bus(n: int) -> None:
        data = encode_positioned(epoch, n, encode_envelope(message(n)))
        delivery.on_bus_message(CHESS, data)

    # 3 answers while 2, another node's, is still on the bus: 3 waits for the bus.
    delivery.deliver_appended(CHESS, Position(epoch, 3), message(3))
    assert server.node.metrics.value(at_append) == 0
    from_bus(2)
    from_bus(3)
    # 4 answers before its copy: delivered now, the copy dropped.
    delivery.deliver_appended(CHESS, Position(epoch, 4), message(4))
    assert server.node.metrics.value(at_append) == 1
    from_bus(4)
    # A repeat's answer (an earlier position), and a new epoch, are the bus's to tell.
    delivery.deliver_appended(CHESS, Position(epoch, 2), message(2))
    delivery.deliver_appended(CHESS, Position("other", 5), message(5))
    assert server.node.metrics.value(at_append) == 1
    for client in (watcher, plain):
        await client.barrier()
        assert [m["payload"]["n"] for m in client.of_verb("game")] == [1, 2, 3, 4]
    assert watcher.offsets(CHESS) == [1, 2, 3, 4]
    assert watcher.recovered(CHESS) == []
