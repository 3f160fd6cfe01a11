"""Acknowledgements and heartbeats (docs/protocol.md, "Acknowledgements and heartbeats"),
over real sockets: an ``ack`` comes once the whole action is applied, errors of an
acked action carry its ``ackId``, a refused action is never acked, and only sockets
that asked get ``heartbeat`` frames."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from server.store import BotRecord, CurrentGame, MemoryStore
from tests.client import Client, dev_token
from tests.conftest import TEST_SETTINGS, RunningServer, run_server
from tests.tokens import BOT_SCOPE, JwksServer
from tests.waiting import eventually

NEW_VERBS = {"ack", "heartbeat"}


def verbs(client: Client) -> list[str]:
    return [m["verb"] for m in client.messages]


async def subscribe(client: Client, user_id: str, **fields: Any) -> None:
    await client.send({"action": "subscribe", "token": dev_token(user_id), **fields})


async def ack_of(client: Client, ack_id: str) -> dict[str, Any]:
    message = await client.next_message(
        lambda m: m["verb"] == "ack" and m["payload"]["ackId"] == ack_id
    )
    payload: dict[str, Any] = message["payload"]
    return payload


def heard_heartbeat(client: Client) -> Callable[[], bool]:
    return lambda: "heartbeat" in verbs(client)


def index_of(client: Client, predicate: Any) -> int:
    return next(i for i, m in enumerate(client.messages) if predicate(m))


async def test_a_subscribe_is_acked_after_its_snapshot_and_recovery(server: RunningServer) -> None:
    game = {"meta": "chess", "id": "g1"}
    status, _ = await server.publish({"verb": "game", "payload": game})
    assert status == 202
    client = await server.client()
    await subscribe(
        client,
        "alice",
        watchVersion=1,
        games=[game],
        since={"game:chess#g1": {"epoch": "", "offset": 0}},
        ackId="s1",
    )
    assert await ack_of(client, "s1") == {"ackId": "s1", "action": "subscribe"}
    seen = verbs(client)
    # snapshot, then the since answer, then the ack: nothing of the action after it
    assert seen.index("connections") < seen.index("recovered") < seen.index("ack")


async def test_watch_games_is_acked_after_its_replay(server: RunningServer) -> None:
    client = await server.subscribed("alice", since={})
    status, reply = await server.publish({"verb": "game", "payload": {"meta": "go", "id": "g"}})
    assert status == 202 and isinstance(reply, dict), reply
    epoch = reply["positions"]["game:go#g"]["epoch"]
    await client.send(
        {
            "action": "watchGames",
            "games": [{"meta": "go", "id": "g"}],
            "since": {"game:go#g": {"epoch": epoch, "offset": 0}},
            "ackId": "w1",
        }
    )
    assert await ack_of(client, "w1") == {"ackId": "w1", "action": "watchGames"}
    replayed = index_of(client, lambda m: m.get("stream") == "game:go#g")
    recovered = index_of(client, lambda m: m["verb"] == "recovered")
    acked = index_of(client, lambda m: m["verb"] == "ack")
    assert replayed < recovered < acked
    assert client.recovered("game:go#g") == [
        {"stream": "game:go#g", "recovered": True, "epoch": epoch, "offset": 1}
    ]


@pytest.mark.parametrize("server", [{"max_watched_games_per_user": 2}], indirect=True)
async def test_a_refused_watch_games_gets_its_error_and_no_ack(server: RunningServer) -> None:
    client = await server.subscribed("alice", games=[("chess", "a")])
    games = [{"meta": "chess", "id": i} for i in "bcd"]
    await client.send({"action": "watchGames", "games": games, "ackId": "w2"})
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "too_many_games"
    assert error["payload"]["ackId"] == "w2"
    await client.barrier()
    assert "ack" not in verbs(client)
    (session,) = server.node.index.by_user["alice"]
    assert session.watching == frozenset({"chess#a"})  # the old set stays


@pytest.mark.parametrize("server", [{"max_watched_games_per_user": 2}], indirect=True)
async def test_a_subscribe_over_the_games_cap_is_acked_with_no_games(
    server: RunningServer,
) -> None:
    client = await server.client()
    games = [{"meta": "chess", "id": i} for i in "abc"]
    await subscribe(client, "alice", watchVersion=1, games=games, ackId="s2")
    await ack_of(client, "s2")
    error = client.of_verb("error")
    assert [e["payload"]["code"] for e in error] == ["too_many_games"]
    assert error[0]["payload"]["ackId"] == "s2"
    assert verbs(client).index("error") < verbs(client).index("ack")
    (session,) = server.node.index.by_user["alice"]
    assert session.watching == frozenset()


async def test_a_refused_token_gets_the_ack_id_and_a_close_and_no_ack(
    server: RunningServer,
) -> None:
    client = await server.client()
    await client.send({"action": "subscribe", "token": "not-a-jwt", "ackId": "s3"})
    assert (await client.closed())[0] == 1008
    (error,) = client.of_verb("error")
    assert error["payload"]["code"] == "unauthorized" and error["payload"]["ackId"] == "s3"
    assert "ack" not in verbs(client)
    missing = await server.client()
    await missing.send({"action": "subscribe", "ackId": "s4"})  # no token at all
    assert (await missing.closed())[0] == 1008
    assert missing.of_verb("error")[0]["payload"]["ackId"] == "s4"


@pytest.mark.parametrize("server", [{"max_connections_per_user": 1}], indirect=True)
async def test_too_many_connections_carries_the_ack_id_before_4509(
    server: RunningServer,
) -> None:
    await server.subscribed("alice")
    second = await server.client()
    await subscribe(second, "alice", ackId="s5")
    assert (await second.closed())[0] == 4509
    (error,) = second.of_verb("error")
    assert error["payload"] == {
        "code": "too_many_connections",
        "message": error["payload"]["message"],
        "ackId": "s5",
    }
    assert "ack" not in verbs(second)


@pytest.mark.parametrize("ack_id", [7, "", "x" * 65, True, ["a"]])
async def test_a_malformed_ack_id_applies_nothing(server: RunningServer, ack_id: Any) -> None:
    client = await server.client()
    await subscribe(client, "alice", ackId=ack_id)
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "invalid_message"
    assert "ackId" not in error["payload"]  # not a usable one to echo
    await client.barrier()
    assert "alice" not in server.node.index.by_user  # nothing applied
    assert client.ws.close_code is None  # and the socket stays open


async def test_an_invalid_action_echoes_a_usable_ack_id(server: RunningServer) -> None:
    client = await server.subscribed("alice")
    await client.send(
        {"action": "watchGames", "games": [], "since": {"s": {"epoch": 1}}, "ackId": "w3"}
    )
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "invalid_message"
    assert error["payload"]["ackId"] == "w3"
    await client.barrier()
    assert "ack" not in verbs(client)


async def test_watch_games_before_subscribe_is_not_subscribed_with_its_ack_id(
    server: RunningServer,
) -> None:
    client = await server.client()
    await client.send({"action": "watchGames", "games": [], "ackId": "w4"})
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "not_subscribed" and error["payload"]["ackId"] == "w4"
    await client.barrier()
    assert "ack" not in verbs(client)


async def test_a_stream_not_allowed_carries_the_ack_id_and_the_rest_is_acked(
    server: RunningServer,
) -> None:
    client = await server.client()
    since = {"user:bob": {"epoch": "", "offset": 0}, "user:alice": {"epoch": "", "offset": 0}}
    await subscribe(client, "alice", since=since, ackId="s6")
    await ack_of(client, "s6")
    (error,) = client.of_verb("error")
    assert error["payload"]["code"] == "stream_not_allowed"
    assert error["payload"]["ackId"] == "s6"
    assert [r["stream"] for r in client.recovered("user:alice")] == ["user:alice"]


async def test_errors_of_unacked_actions_carry_no_ack_id(server: RunningServer) -> None:
    client = await server.client()
    await client.send({"action": "subscribe", "token": "not-a-jwt"})
    assert (await client.closed())[0] == 1008
    (error,) = client.of_verb("error")
    assert "ackId" not in error["payload"]


@pytest.mark.parametrize("server", [{"heartbeat_seconds": 1}], indirect=True)
async def test_heartbeats_go_only_to_the_sockets_that_asked(server: RunningServer) -> None:
    plain = await server.subscribed("bob", since={})
    await plain.watch([("chess", "g1")], since={})
    beating = await server.client()
    await subscribe(beating, "alice", heartbeat=True, ackId="s7")
    assert await ack_of(beating, "s7") == {
        "ackId": "s7",
        "action": "subscribe",
        "heartbeatSeconds": 1,
    }
    await beating.wait_for(lambda: verbs(beating).count("heartbeat") >= 2, within=10)
    (frame,) = {str(m) for m in beating.of_verb("heartbeat")}
    assert frame == str({"verb": "heartbeat", "payload": {}})
    # Two ticks went by: a client that sent none of the new fields saw no new verb.
    assert NEW_VERBS.isdisjoint(verbs(plain))
    # A re-subscribe without the flag stops them.
    await subscribe(beating, "alice", ackId="s8")
    assert await ack_of(beating, "s8") == {"ackId": "s8", "action": "subscribe"}
    assert server.node.index.heartbeats == set()


@pytest.mark.parametrize("server", [{"heartbeat_seconds": 1}], indirect=True)
async def test_one_heartbeat_frame_serves_every_socket(server: RunningServer) -> None:
    from server.routing.heartbeats import HEARTBEAT_FRAME

    clients = []
    for i in range(3):
        client = await server.client(msgpack_protocol=i == 0)
        await subscribe(client, f"u{i}", heartbeat=True, ackId="a")
        await ack_of(client, "a")
        clients.append(client)
    for client in clients:
        await client.wait_for(heard_heartbeat(client), within=10)
    assert len(server.node.index.heartbeats) == 3
    # The frame is encoded once for the process, not per tick or per socket.
    assert HEARTBEAT_FRAME._text_wire is not None and HEARTBEAT_FRAME._binary_wire is not None
    await clients[1].close()
    await eventually(lambda: len(server.node.index.heartbeats) == 2, 5, "the closed socket to go")


# --- bots: the ack follows pendingTurns ----------------------------------------

BOT = "ack-bot"


@pytest.fixture
async def bot_server() -> AsyncIterator[tuple[RunningServer, JwksServer]]:
    jwks = JwksServer()
    await jwks.start()
    store = MemoryStore()
    store.put_bot(BotRecord(client_id=BOT, name="Acker", owner="owner-1"))
    store.put_current_game(BOT, CurrentGame("g1", "chess", (BOT, "alice"), "0"))
    bots = jwks.pool("bots")
    settings = dataclasses.replace(
        TEST_SETTINGS, bot_cognito_issuer=bots.issuer, bot_scope=BOT_SCOPE
    )
    try:
        async with run_server(settings, store) as server:
            yield server, jwks
    finally:
        await jwks.stop()


async def test_a_bot_subscribe_is_acked_after_its_pending_turns(
    bot_server: tuple[RunningServer, JwksServer],
) -> None:
    server, jwks = bot_server
    token = jwks.pools["/bots/.well-known/jwks.json"].bot_token(BOT)
    client = await server.client()
    await client.send({"action": "subscribe", "token": token, "since": {}, "ackId": "b1"})
    await ack_of(client, "b1")
    seen = verbs(client)
    assert seen.index("pendingTurns") < seen.index("ack")
    assert client.of_verb("pendingTurns")[0]["payload"]["games"] == [{"meta": "chess", "id": "g1"}]


async def test_an_unreachable_pool_is_unavailable_with_the_ack_id_then_1013(
    bot_server: tuple[RunningServer, JwksServer],
) -> None:
    server, jwks = bot_server
    token = jwks.pools["/bots/.well-known/jwks.json"].bot_token(BOT)
    await jwks.stop()
    client = await server.client()
    await client.send({"action": "subscribe", "token": token, "ackId": "b2"})
    assert (await client.closed())[0] == 1013
    (error,) = client.of_verb("error")
    assert error["payload"]["code"] == "unavailable" and error["payload"]["ackId"] == "b2"
    assert "ack" not in verbs(client)
