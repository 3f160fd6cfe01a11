"""Streams on Redis: one Lua script per event assigns, keeps and publishes.

Keys of a stream ``s`` (``docs/cluster.md``, "Streams"), all under the hash
tag ``{s}`` of the stream's own channel ``ap:{s}``, so one script touches
them in one Redis Cluster slot:

- ``ap:{s}:meta``: a hash, ``e`` the epoch and ``s`` the top offset; expires
  ``meta_ttl`` after the last event;
- ``ap:{s}:hist``: a Redis stream of the last ``history_size`` events, entry id
  ``<offset>-0`` and one field ``d`` (the envelope); expires ``history_ttl``
  after the last event.
- ``ap:{s}:id:<event id>``: the position an event took (``<epoch>:<offset>``);
  expires after its window (``server/bus/streams.py``, ``id_window``: 5 min for
  names the server made, 24 h for notifications, 15 min for other names from
  outside).

An append may carry a ``Fence``: a lease key in the stream's slot (a game's
chat lock) that the script checks, and releases after the append if asked,
so a chat post's events and its lock's release are one round trip.

``APPEND`` (``lua/stream_append.lua``) creates the epoch if the meta is gone
(a new epoch starts at offset 1 and drops any old history), takes the next
offset with ``HINCRBY``, appends with an exact ``MAXLEN``, refreshes both ttls
and publishes the positioned message on each channel given. Redis runs scripts one
at a time, so positions are assigned and published in one order for everyone.
Every append names its event (one without a name is named here, before the
first attempt), so every resend of the script (redis-py's retry after a lost
connection, a pipelined call sent again, a command resent through a failover)
carries the same name: the script first looks for the id key, and if it is
there returns the position stored in it and does nothing else; if not, it
appends and sets it.

On one Redis the appends of concurrent callers go out together, one write per
round trip on a connection of their own (:mod:`server.redis.coalesce`), still one
script run per event. So do the history reads, on a connection of their own: a
recovery storm's reads and the appends never queue behind each other.

On a Redis Cluster (:meth:`RedisStreams.on_cluster`) the script runs on the
shard of the stream's slot and publishes with ``SPUBLISH`` only on the
channels of that slot (the stream's own: ``ap:{game:<meta>#<id>}``,
``ap:{user:<id>}``); a channel of another slot (``ap:{games}``, for legacy
clients) is published by the caller as the script's reply arrives, with the
position it returned, without waiting for it (replies arrive in offset order,
and :meth:`ShardPipes.publish_in_order` keeps that order). A script may not
reach into another slot. Scripts and publishes go over the bus's
:class:`~server.redis.shard_pipes.ShardPipes`, not redis-py's cluster client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from redis.crc import key_slot

from protocol.envelope import encode_positioned
from protocol.messages import Position
from protocol.streams import HistoryRead
from server.bus.redis_cluster_bus import RedisClusterBus
from server.bus.streams import (
    DEFAULT_LIMITS,
    OWN_NAME,
    Append,
    Fence,
    HistoryAsk,
    StreamLimits,
    id_window,
    new_epoch,
    new_event_id,
)
from server.redis.client import make_client
from server.redis.coalesce import ScriptCoalescer
from server.redis.keys import channel_for
from server.redis.scripts import Script, for_bus, lua
from server.redis.shard_pipes import ShardPipes

APPEND = lua("server.bus", "stream_append")
READ = lua("server.bus", "stream_read")


def _ms(seconds: float) -> int:
    """A ttl for ``PEXPIRE``: milliseconds, at least one."""
    return max(1, round(seconds * 1000))


def meta_key(stream: str) -> str:
    return "ap:{" + stream + "}:meta"


def history_key(stream: str) -> str:
    return "ap:{" + stream + "}:hist"


def event_id_key(stream: str, event_id: str) -> str:
    return "ap:{" + stream + "}:id:" + event_id


def append_keys(stream: str, event_id: str, fence: Fence | None = None) -> list[str]:
    keys = [meta_key(stream), history_key(stream), event_id_key(stream, event_id)]
    return keys if fence is None else [*keys, fence.key]


class RedisStreams:
    def __init__(
        self,
        url: str,
        limits: StreamLimits = DEFAULT_LIMITS,
        *,
        client: Any = None,
        pipes: ShardPipes | None = None,
    ) -> None:
        self.url = url
        self._limits = limits
        self._pipes = pipes
        self._sharded = pipes is not None
        self._failover_deadline = 10.0
        if pipes is not None:
            self._shard_append = Script(for_bus(APPEND, sharded=True))
            self._shard_read = Script(READ)
            return
        self._client = make_client(url, retries=1) if client is None else client
        self._appends = ScriptCoalescer(self._client, APPEND)
        self._reads = ScriptCoalescer(self._client, READ)

    @classmethod
    def on_cluster(
        cls, bus: RedisClusterBus, limits: StreamLimits = DEFAULT_LIMITS
    ) -> RedisStreams:
        """Streams on the Redis Cluster of ``bus``, over its per-primary connections."""
        streams = cls(bus.url, limits, pipes=bus.pipes)
        streams._failover_deadline = bus.publish_deadline
        return streams

    async def start(self) -> None:
        if self._pipes is not None:
            await self._pipes.start()  # the slot map before the first command

    async def close(self) -> None:
        if self._pipes is None:  # the bus closes its pipes
            await self._appends.close()
            await self._reads.close()
            await self._client.aclose()

    def _append_args(
        self, data: bytes, topics: Sequence[str], event_id: str, fence: Fence | None
    ) -> list[Any]:
        limits = self._limits
        return [
            data,
            limits.history_size,
            _ms(limits.history_ttl),
            _ms(limits.meta_ttl),
            new_epoch(),
            _ms(id_window(limits, event_id)),
            "" if fence is None else fence.token,
            "1" if fence is not None and fence.release else "0",
            *[channel_for(topic) for topic in topics],
        ]

    async def append(
        self, stream: str, data: bytes, topics: Sequence[str], event_id: str | None = None
    ) -> Position:
        return await self._append_one(Append(stream, data, topics, event_id))

    async def _append_one(self, item: Append) -> Position:
        event_id = new_event_id() if item.event_id is None else item.event_id
        keys = append_keys(item.stream, event_id, item.fence)
        if self._pipes is None:
            args = self._append_args(item.data, item.topics, event_id, item.fence)
            (reply,) = await self._appends.run([(keys, args)])
            return _position(reply, item.fence)
        return await self._append_on_shard(self._pipes, keys, item, event_id)

    async def _append_on_shard(
        self, pipes: ShardPipes, keys: list[str], item: Append, event_id: str
    ) -> Position:
        data, topics = item.data, item.topics
        slot = key_slot(keys[0].encode())
        here: list[str] = []
        elsewhere: list[tuple[int, str]] = []
        for topic in topics:
            channel = channel_for(topic)
            channel_slot = key_slot(channel.encode())
            if channel_slot == slot:
                here.append(topic)
            else:
                elsewhere.append((channel_slot, channel))
        if item.fence is not None and key_slot(item.fence.key.encode()) != slot:
            raise ValueError(f"fence {item.fence.key!r} is not in the slot of {item.stream!r}")
        args = self._append_args(data, here, event_id, item.fence)
        deadline = time.monotonic() + self._failover_deadline
        reply = await pipes.script(slot, self._shard_append, keys, args, deadline)
        position = _position(reply, item.fence)
        if elsewhere and (int(reply[2]) == 0 or event_id.startswith(OWN_NAME)):
            # Nothing awaited since the reply: replies come in offset order, so
            # the publishes are queued in offset order too. A repeat of a name
            # from outside was published by its first caller; a repeat of one
            # made here is this call's own resend, whose first reply was lost
            # before its publish could go out.
            message = encode_positioned(position.epoch, position.offset, data)
            for channel_slot, channel in elsewhere:
                pipes.publish_in_order(channel_slot, channel, message, self._failover_deadline)
        return position

    async def append_many(self, items: Sequence[Append]) -> list[Position]:
        if self._sharded:
            # Streams are slots of their own, maybe on other shards, and no
            # pipeline spans slots: each stream's items in order, streams at once.
            if len(items) == 1:
                return [await self._append_one(items[0])]
            positions: dict[int, Position] = {}
            by_stream: dict[str, list[int]] = {}
            for index, item in enumerate(items):
                by_stream.setdefault(item.stream, []).append(index)

            async def in_order(indexes: list[int]) -> None:
                for index in indexes:
                    positions[index] = await self._append_one(items[index])

            await asyncio.gather(*(in_order(indexes) for indexes in by_stream.values()))
            return [positions[index] for index in range(len(items))]
        calls = []
        for item in items:
            event_id = new_event_id() if item.event_id is None else item.event_id
            keys = append_keys(item.stream, event_id, item.fence)
            calls.append((keys, self._append_args(item.data, item.topics, event_id, item.fence)))
        replies = await self._appends.run(calls)
        return [_position(reply, item.fence) for reply, item in zip(replies, items, strict=True)]

    def _read_call(self, stream: str, after: int) -> tuple[list[str], list[Any]]:
        """The ``READ`` script's keys and arguments for one stream."""
        limits = self._limits
        args = [after, limits.history_size, new_epoch(), _ms(limits.meta_ttl)]
        return [meta_key(stream), history_key(stream)], args

    async def read(self, stream: str, after: int) -> HistoryRead[bytes]:
        keys, args = self._read_call(stream, after)
        if self._pipes is None:
            (reply,) = await self._reads.run([(keys, args)])
            return _history(reply)
        deadline = time.monotonic() + self._failover_deadline
        slot = key_slot(keys[0].encode())
        return _history(await self._pipes.script(slot, self._shard_read, keys, args, deadline))

    async def read_many(self, asks: Sequence[HistoryAsk]) -> list[HistoryRead[bytes]]:
        if not asks:
            return []
        if len(asks) == 1:
            return [await self.read(*asks[0])]
        if self._sharded:
            # No pipeline spans slots: the reads go out at once, and each
            # primary's pipe sends those of its slots together.
            return list(await asyncio.gather(*(self.read(s, after) for s, after in asks)))
        calls = [self._read_call(stream, after) for stream, after in asks]
        return [_history(reply) for reply in await self._reads.run(calls)]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _history(reply: Any) -> HistoryRead[bytes]:
    epoch, top, raw = reply
    entries: list[tuple[int, bytes]] = []
    for entry_id, fields in raw:
        offset = int(bytes(entry_id).split(b"-", 1)[0])
        entries.append((offset, bytes(fields[1])))
    return HistoryRead(_text(epoch), int(top), tuple(entries))


def _position(reply: Any, fence: Fence | None = None) -> Position:
    if fence is not None:
        fence.applied = True
        fence.lost = int(reply[3]) == 0
    return Position(_text(reply[0]), int(reply[1]))
