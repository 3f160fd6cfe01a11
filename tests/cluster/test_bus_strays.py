"""Messages on a node's channels that no node wrote (a bug elsewhere, a stray
``PUBLISH`` by hand): each is counted and dropped, and what follows is delivered
as if it had never been there. A whole node on a real Redis, sent to with a plain
redis-py client."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import redis.asyncio as aioredis

from protocol.envelope import encode_positioned
from server.redis.keys import channel_for
from tests.conftest import TEST_SETTINGS, run_server
from tests.services import RedisServer
from tests.waiting import eventually

GAME = "game:chess#g1"


def move(n: int) -> dict[str, Any]:
    return {"verb": "game", "payload": {"meta": "chess", "id": "g1", "n": n}}


async def test_strays_on_a_game_channel_are_counted_dropped_and_the_game_goes_on(
    fresh_redis: RedisServer,
) -> None:
    settings = dataclasses.replace(TEST_SETTINGS, redis_url=fresh_redis.url)
    async with run_server(settings) as server:
        watcher = await server.subscribed("alice", games=[("chess", "g1")], since={})
        assert (await server.publish(move(1)))[0] == 202
        await watcher.wait_for(lambda: watcher.offsets(GAME) == [1])
        epoch = watcher.on_stream(GAME)[0]["epoch"]
        strays = [
            b"not an envelope",
            b"\x00no position",
            # The next position of the game, with a body no node wrote: dropped
            # without taking that position from the real event 2.
            encode_positioned(epoch, 2, json.dumps(move(2)).encode()),
        ]
        redis = aioredis.Redis.from_url(fresh_redis.url)
        try:
            for stray in strays:
                assert await redis.publish(channel_for(GAME), stray) >= 1  # the node heard it
        finally:
            await redis.aclose()
        metrics = server.node.metrics
        dropped = lambda: metrics.value("ap_bus_bad_envelopes_total") == len(strays)  # noqa: E731
        await eventually(dropped, 5, "every stray dropped")
        assert (await server.publish(move(2)))[0] == 202
        await watcher.wait_for(lambda: len(watcher.offsets(GAME)) == 2)
        await watcher.barrier()
        assert watcher.offsets(GAME) == [1, 2]
        assert [frame["payload"]["n"] for frame in watcher.on_stream(GAME)] == [1, 2]
        assert metrics.value("ap_stream_gaps_total") == 0
        assert watcher.ws.close_code is None
