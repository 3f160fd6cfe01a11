"""A comment's Redis round trips, counted on a real redis-server through a counting
proxy (never timed): the rate, the game's lock, and one append of the chat event
and the game hint that also releases the lock."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from loadtest.harness.faults import TcpFaultProxy
from server.coordination.game_lock import lock_key
from server.store.memory import MemoryStore
from tests.chat_helpers import post, seed_game
from tests.conftest import TEST_SETTINGS, RunningServer, run_server
from tests.rows import Rows
from tests.services import RedisServer

GAME = ("chess", "rtgame")
AUTHOR = "rtauthor"


@pytest.fixture
async def redis_node(redis_proxy: TcpFaultProxy) -> AsyncIterator[RunningServer]:
    store = MemoryStore()
    seed_game(Rows(store), GAME, [AUTHOR, "other"])
    # No stream audit: its reads name the game too, and one may fall in the count.
    settings = dataclasses.replace(
        TEST_SETTINGS, redis_url=redis_proxy.url + "/0", chat_rate=100, stream_audit_seconds=0
    )
    async with run_server(settings, store) as running:
        yield running


def chat_round_trips(requests: list[bytearray]) -> list[bytes]:
    """Round trips about the game or the author's rate (nothing else names them)."""
    return [
        bytes(r) for r in requests if b"rtgame" in r or b"{user:" + AUTHOR.encode() + b"}:rate" in r
    ]


async def test_a_comment_costs_three_redis_round_trips(
    redis_node: RunningServer, redis_proxy: TcpFaultProxy, fresh_redis: RedisServer
) -> None:
    author = await redis_node.subscribed(AUTHOR)
    watcher = await redis_node.subscribed("rtwatcher", games=[GAME])
    await post(author, GAME, "warm-up")  # scripts loaded, connections open
    await watcher.wait_for(lambda: bool(watcher.of_verb("chat")), 10)
    requests = redis_proxy.record_round_trips()
    for number in range(5):
        reply = await post(author, GAME, f"comment {number}")
        assert reply["verb"] == "chatAck", reply
    await watcher.wait_for(lambda: len(watcher.of_verb("chat")) == 6, 10)
    trips = chat_round_trips(requests)
    assert len(trips) == 5 * 3, [t[:120] for t in trips]
    # The last of each comment's three: both events and the lock's key, in one.
    appends = [t for t in trips if b"chat-lock" in t and t.count(b"EVALSHA") >= 2]
    assert len(appends) == 5
    # In order: the chat event, then the hint, each once.
    verbs = [m["verb"] for m in watcher.messages if m.get("verb") in ("chat", "game")]
    assert verbs == ["chat", "game"] * 6
    # The append released the lock: nothing holds the game now.
    client = redis.asyncio.Redis.from_url(fresh_redis.url)
    try:
        assert await client.exists(lock_key("chess#rtgame")) == 0
    finally:
        await client.aclose()
