"""Bad input never crashes anything: an error frame or a defined close code, and the node
goes on."""

from __future__ import annotations

import json
import random
from typing import Any

import msgpack
import pytest

from tests.client import Client, dev_token
from tests.conftest import RunningServer


async def error_after(client: Client, frame: str | bytes) -> dict[str, str]:
    count = len(client.of_verb("error"))
    await client.ws.send(frame)
    await client.wait_for(lambda: len(client.of_verb("error")) > count)
    payload: dict[str, str] = client.of_verb("error")[-1]["payload"]
    return payload


async def test_invalid_json_gets_an_error_and_the_connection_stays(server: RunningServer) -> None:
    client = await server.subscribed("alice")
    error = await error_after(client, "{this is not json")
    assert error == {"code": "invalid_frame", "message": "frame is not valid JSON"}
    await client.barrier()  # still open and served


async def test_unknown_action_gets_an_error_and_the_connection_stays(
    server: RunningServer,
) -> None:
    client = await server.subscribed("alice")
    error = await error_after(client, json.dumps({"action": "launchMissiles"}))
    assert error["code"] == "unknown_action" and "launchMissiles" in error["message"]
    await client.barrier()


async def test_actions_before_subscribe_get_not_subscribed(server: RunningServer) -> None:
    client = await server.client()
    for action in ({"action": "watchGames", "games": []}, {"action": "syncPresence"}):
        error = await error_after(client, json.dumps(action))
        assert error == {"code": "not_subscribed", "message": "Not subscribed"}
    await client.subscribe("alice")  # the connection is still usable
    assert client.presence.snapshots == 1


async def test_a_bad_token_gets_an_error_then_close_1008(server: RunningServer) -> None:
    client = await server.client()
    await client.send({"action": "subscribe", "token": "not.a.token"})
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "unauthorized"
    assert await client.closed() == (1008, "invalid token")
    assert not server.node.index.by_user


async def test_an_expired_token_gets_close_1008(server: RunningServer) -> None:
    client = await server.client()
    await client.send({"action": "subscribe", "token": dev_token("u", expires_in=-600)})
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert "expired" in error["payload"]["message"]
    assert (await client.closed())[0] == 1008


async def test_a_missing_token_gets_close_1008(server: RunningServer) -> None:
    client = await server.client()
    await client.send({"action": "subscribe"})
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "unauthorized"
    assert (await client.closed())[0] == 1008


async def test_a_frame_over_64_kib_gets_close_1009(server: RunningServer) -> None:
    client = await server.subscribed("alice")
    await client.ws.send(json.dumps({"action": "syncPresence", "pad": "x" * 70_000}))
    code, _ = await client.closed()
    assert code == 1009
    survivor = await server.subscribed("bob")  # the node goes on
    assert survivor.presence.snapshots == 1


async def test_a_frame_just_under_the_limit_is_fine(server: RunningServer) -> None:
    client = await server.subscribed("alice")
    await client.ws.send(json.dumps({"action": "syncPresence", "pad": "x" * 60_000}))
    await client.barrier()


async def test_binary_garbage_gets_an_error(server: RunningServer) -> None:
    client = await server.subscribed("alice")
    error = await error_after(client, b"\xc1\xff\x00")
    assert error["code"] == "invalid_frame"
    await client.barrier()


async def test_too_many_games_gets_an_error_and_keeps_the_old_set(server: RunningServer) -> None:
    client = await server.subscribed("alice", games=[("chess", "g1")])
    games = [{"meta": "m", "id": str(i)} for i in range(1001)]
    error = await error_after(client, json.dumps({"action": "watchGames", "games": games}))
    assert error["code"] == "too_many_games"
    await client.barrier()
    assert set(server.node.index.by_game) == {"chess#g1"}


def random_frames(seed: int, count: int) -> list[str | bytes]:
    """Frames of every shape except a subscribe, which would end the session by design."""
    rng = random.Random(seed)
    actions = ["watchGames", "syncPresence", "dance", "", None, 7, ["x"]]
    values = [None, True, 0, -1, 2**60, 1.5, "x", "", [], {}, [{"meta": "m"}], {"a": 1}]
    frames: list[str | bytes] = []
    for _ in range(count):
        kind = rng.randrange(5)
        if kind == 0:
            frames.append(bytes(rng.randrange(256) for _ in range(rng.randrange(64))))
        elif kind == 1:
            frames.append("".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(64))))
        else:
            message: dict[str, Any] = {"action": rng.choice(actions)}
            for key in ("games", "token", "invisible", "watchVersion"):
                if rng.random() < 0.5:
                    message[key] = rng.choice(values)
            if kind == 4:
                broken = json.dumps(message)[:-1]
                frames.append(msgpack.packb(message) if rng.random() < 0.5 else broken)
            else:
                frames.append(json.dumps(message))
    return frames


# 500 frames from one socket is a flood by the default credits; this test is about parsing.
@pytest.mark.parametrize("server", [{"flood_credits": 10_000}], indirect=True)
async def test_random_frames_never_hurt_the_node(server: RunningServer) -> None:
    victim = await server.subscribed("fuzzer")
    for frame in random_frames(seed=2026, count=500):
        await victim.ws.send(frame)
    await victim.barrier()  # every frame was handled and the session still answers
    assert len(victim.of_verb("error")) > 100
    bystander = await server.subscribed("bystander")
    assert bystander.presence.snapshots == 1
