"""Which bots hold a WebSocket session somewhere in the cluster.

Bots are not in presence (their users never see them come and go), yet the bot
queue bridge must know, for each message, whether its bot can be told over a
socket or must be left to its webhook. Each node marks the bots it serves, with
an expiry it renews while they stay; a killed node's marks lapse within
``MARK_SECONDS``. During that window a message goes to the bot's user stream,
where the bot finds it with ``since`` when it reconnects elsewhere.

A mark is written *before* the bot's pending turns are read (``BotService``):
the bridge writes a move's candidate before it looks here, so a bot that
connects just after a message was forwarded still finds the game pending.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection
from typing import Protocol

from redis.exceptions import RedisError

from server.redis.client import command_client_for

MARK_SECONDS = 30.0
"""How long a node's mark of a bot lasts unless renewed (every third of it)."""

MARK_CHUNK = 500
"""Bots per pipelined renewal."""


class BotSessions(Protocol):
    """Marks of one node (named when built) and everyone's marks."""

    async def mark(self, bot_ids: Collection[str]) -> None:
        """This node serves these bots: (re)mark them for ``MARK_SECONDS``."""

    async def unmark(self, bot_id: str) -> None:
        """This node's last session of the bot closed."""

    async def connected(self, bot_id: str) -> bool:
        """Whether any node's mark of the bot is current."""

    async def close(self) -> None: ...


class MemoryBotSessions:
    """One process is the whole cluster."""

    def __init__(self, node_id: str = "embedded") -> None:
        self._node_id = node_id
        self._marks: dict[str, dict[str, float]] = {}  # bot -> node -> expires (monotonic)

    async def mark(self, bot_ids: Collection[str]) -> None:
        until = time.monotonic() + MARK_SECONDS
        for bot_id in bot_ids:
            self._marks.setdefault(bot_id, {})[self._node_id] = until

    async def unmark(self, bot_id: str) -> None:
        nodes = self._marks.get(bot_id)
        if nodes is not None:
            nodes.pop(self._node_id, None)
            if not nodes:
                del self._marks[bot_id]

    async def connected(self, bot_id: str) -> bool:
        now = time.monotonic()
        return any(until > now for until in self._marks.get(bot_id, {}).values())

    async def close(self) -> None:
        return None


def sessions_key(bot_id: str) -> str:
    """In the bot's user hash tag, beside its other keys."""
    return "ap:{user:" + bot_id + "}:botSessions"


class RedisBotSessions:
    """One sorted set per bot: member a node id, score the mark's expiry (epoch ms).

    Every command names one key, so it works unchanged on a Redis Cluster. Errors
    propagate: the bridge then hands its message back rather than guess.
    """

    def __init__(self, url: str, node_id: str, *, cluster: bool = False) -> None:
        self._client = command_client_for(url, cluster=cluster)
        self._node_id = node_id

    async def mark(self, bot_ids: Collection[str]) -> None:
        now_ms = int(time.time() * 1000)
        until = now_ms + int(MARK_SECONDS * 1000)
        ids = list(bot_ids)
        # One pipelined round trip per chunk, not three per bot: a node renews all
        # its bots every few seconds.
        for start in range(0, len(ids), MARK_CHUNK):
            async with self._client.pipeline(transaction=False) as pipe:
                for bot_id in ids[start : start + MARK_CHUNK]:
                    key = sessions_key(bot_id)
                    pipe.zadd(key, {self._node_id: until})
                    pipe.zremrangebyscore(key, "-inf", now_ms)
                    pipe.pexpire(key, int(MARK_SECONDS * 2000))
                await pipe.execute()

    async def unmark(self, bot_id: str) -> None:
        await self._client.zrem(sessions_key(bot_id), self._node_id)

    async def connected(self, bot_id: str) -> bool:
        now_ms = int(time.time() * 1000)
        count = await self._client.zcount(sessions_key(bot_id), now_ms, "+inf")
        return int(count) > 0

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
