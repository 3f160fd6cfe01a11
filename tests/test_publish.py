"""Game event fan-out through POST /publish, routed like today's message router."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from protocol import codec
from tests.client import Client
from tests.conftest import PUBLISH_SECRET, RunningServer


def move(meta: str, game_id: str, verb: str = "game", **extra: Any) -> dict[str, Any]:
    return {"verb": verb, "payload": {"meta": meta, "id": game_id, **extra}}


async def quiet(client: Client, verb: str, wait: float = 0.3) -> bool:
    """True when ``client`` received no ``verb`` frame within ``wait`` seconds."""
    await asyncio.sleep(wait)
    await client.barrier()
    return not client.of_verb(verb)


async def test_targeted_watchers_get_only_their_games(server: RunningServer) -> None:
    chess = await server.subscribed("alice", games=[("chess", "g1")])
    go = await server.subscribed("bob", games=[("go", "g2")])
    status, reply = await server.publish(move("chess", "g1", n=1))
    assert status == 202 and isinstance(reply, dict)
    position = reply["positions"]["game:chess#g1"]
    assert reply == {"accepted": True, "positions": {"game:chess#g1": position}}
    assert position["offset"] == 1 and isinstance(position["epoch"], str)
    event = await chess.next_message(lambda m: m["verb"] == "game")
    # Old clients read verb and payload; the stream position is additive.
    assert event == {
        "verb": "game",
        "payload": {"meta": "chess", "id": "g1", "n": 1},
        "stream": "game:chess#g1",
        "epoch": position["epoch"],
        "offset": 1,
    }
    assert await quiet(go, "game")


async def test_watch_version_one_with_no_games_gets_no_game_events(
    server: RunningServer,
) -> None:
    strict = await server.subscribed("alice", games=[])
    await server.publish(move("chess", "g1"))
    assert await quiet(strict, "game")


async def test_legacy_connections_get_every_game_event(server: RunningServer) -> None:
    legacy = await server.subscribed("old", watch_version=None)
    await server.publish(move("chess", "g1"))
    await server.publish(move("go", "g9", verb="chat"))
    await legacy.next_message(lambda m: m["verb"] == "chat")
    assert [m["payload"]["id"] for m in legacy.messages if m["verb"] in ("game", "chat")] == [
        "g1",
        "g9",
    ]


async def test_a_legacy_client_that_starts_watching_becomes_strict(
    server: RunningServer,
) -> None:
    client = await server.subscribed("old", watch_version=None)
    await client.watch([("go", "g2")])
    await client.barrier()
    await server.publish(move("chess", "g1"))
    await server.publish(move("go", "g2"))
    event = await client.next_message(lambda m: m["verb"] == "game")
    assert event["payload"]["id"] == "g2"
    assert len(client.of_verb("game")) == 1


async def test_chat_routes_like_game(server: RunningServer) -> None:
    watcher = await server.subscribed("alice", games=[("chess", "g1")])
    await server.publish(move("chess", "g1", verb="chat"))
    assert (await watcher.next_message(lambda m: m["verb"] == "chat"))["payload"]["id"] == "g1"


async def test_exclude_skips_every_tab_of_the_acting_user(server: RunningServer) -> None:
    mover_tab1 = await server.subscribed("mover", games=[("chess", "g1")])
    mover_tab2 = await server.subscribed("mover", games=[("chess", "g1")])
    legacy_mover = await server.subscribed("mover", watch_version=None)
    opponent = await server.subscribed("opponent", games=[("chess", "g1")])
    await server.publish({**move("chess", "g1"), "exclude": ["mover"]})
    await opponent.next_message(lambda m: m["verb"] == "game")
    for tab in (mover_tab1, mover_tab2, legacy_mover):
        assert await quiet(tab, "game", wait=0.1)


async def test_test_broadcast_reaches_everyone(server: RunningServer) -> None:
    clients = [
        await server.subscribed("a", games=[("chess", "g1")]),
        await server.subscribed("b", watch_version=None),
        await server.subscribed("c", wants_presence=False),
    ]
    assert (await server.publish({"verb": "test", "payload": "maintenance at noon"}))[0] == 202
    for client in clients:
        message = await client.next_message(lambda m: m["verb"] == "test")
        assert message["payload"] == "maintenance at noon"


async def test_the_frame_is_encoded_once_for_many_recipients(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    watchers = [await server.subscribed(f"u{i}", games=[("chess", "g1")]) for i in range(25)]
    calls: list[Any] = []
    original = codec.to_wire

    def counting(message: Any) -> Any:
        calls.append(message)
        return original(message)

    monkeypatch.setattr(codec, "to_wire", counting)
    await server.publish(move("chess", "g1"))
    for watcher in watchers:
        await watcher.next_message(lambda m: m["verb"] == "game")
    assert [type(m).__name__ for m in calls].count("Positioned") == 1


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"verb": "dance", "payload": {}}, "unknown verb"),
        ({"verb": "game", "payload": {"id": "g1"}}, "'meta' and 'id'"),
        ({"verb": "game", "payload": {"meta": "chess"}}, "'meta' and 'id'"),
        ({"verb": "chat"}, "object payload"),
        ({"verb": "game", "payload": {"meta": "m", "id": "1"}, "exclude": [1]}, "exclude"),
    ],
)
async def test_bad_publishes_get_400_with_a_reason(
    server: RunningServer, body: dict[str, Any], reason: str
) -> None:
    status, response = await server.publish(body)
    assert status == 400
    assert isinstance(response, dict) and reason in response["error"]


async def test_publish_of_invalid_json_gets_400(server: RunningServer) -> None:
    status, response = await server.http("POST", "/publish", raw=b"{nope")
    assert status == 400 and "JSON" in response["error"]  # type: ignore[index]


@pytest.mark.parametrize("secret", [None, "wrong-secret", PUBLISH_SECRET + "x", ""])
async def test_publish_with_a_bad_secret_gets_401(
    server: RunningServer, secret: str | None
) -> None:
    watcher = await server.subscribed("alice", games=[("chess", "g1")])
    status, _ = await server.publish(move("chess", "g1"), secret=secret)
    assert status == 401
    assert await quiet(watcher, "game", wait=0.1)


async def test_oversized_publish_gets_413(server: RunningServer) -> None:
    status, _ = await server.publish(move("chess", "g1", blob="x" * 200_000))
    assert status == 413


@pytest.mark.parametrize("server", [{"publish_secret": None}], indirect=True)
async def test_publish_is_disabled_without_a_secret(server: RunningServer) -> None:
    status, response = await server.publish(move("chess", "g1"), secret="anything")
    assert status == 503 and "publish-secret" in response["error"]  # type: ignore[index]


# The close frame waits behind the full socket until the test reads again; with a
# short close timeout, a slow loop of publishes would see the socket dropped (1006).
@pytest.mark.parametrize(
    "server", [{"outbox_limit_bytes": 256 * 1024, "close_timeout": 120.0}], indirect=True
)
async def test_a_slow_client_is_closed_and_delays_nobody(server: RunningServer) -> None:
    slow = await server.client(max_queue=1)
    await slow.subscribe("slow", games=[("chess", "g1")])
    fast = await server.subscribed("fast", games=[("chess", "g1")])
    transport = slow.ws.transport
    assert transport is not None
    transport.pause_reading()  # the slow client's socket fills up, then the server's buffer
    blob = "x" * 60_000
    for n in range(120):
        status, _ = await server.publish(move("chess", "g1", n=n, blob=blob))
        assert status == 202
        await fast.next_message(lambda m: m["verb"] == "game" and m["payload"]["n"] == n)  # noqa: B023
    transport.resume_reading()
    code, reason = await slow.closed(within=10)
    assert (code, reason) == (4008, "slow consumer")
    for _ in range(100):
        if server.node.index.by_user.keys() == {"fast"}:
            break
        await asyncio.sleep(0.05)
    assert server.node.index.by_user.keys() == {"fast"}


async def test_a_publish_retried_with_its_idempotency_key_is_delivered_once(
    server: RunningServer,
) -> None:
    watcher = await server.subscribed("alice", games=[("chess", "g7")])
    key = {"Idempotency-Key": "move-17"}
    status, first = await server.publish(move("chess", "g7", n=1), headers=key)
    assert status == 202
    status, again = await server.publish(move("chess", "g7", n=1), headers=key)
    assert status == 202 and again == first  # the position the event already has
    status, other = await server.publish(move("chess", "g7", n=2))
    assert status == 202 and isinstance(other, dict) and isinstance(first, dict)
    assert other["positions"]["game:chess#g7"]["offset"] == 2
    await watcher.next_message(lambda m: m["verb"] == "game" and m["payload"]["n"] == 2)
    assert [m["offset"] for m in watcher.messages if m["verb"] == "game"] == [1, 2]


@pytest.mark.parametrize("key", ["", "x" * 201, "tab\there"])
async def test_a_bad_idempotency_key_is_refused(server: RunningServer, key: str) -> None:
    status, reply = await server.publish(move("chess", "g8"), headers={"Idempotency-Key": key})
    assert status == 400 and isinstance(reply, dict) and "Idempotency-Key" in reply["error"]
