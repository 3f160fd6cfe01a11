"""Where bus topics live in Redis: the channel of each topic, and the presence namespace.

The hash tag in braces decides a key's Redis Cluster slot, so these names are
what keeps a game's channel and keys, or all of presence, on one shard.
"""

from __future__ import annotations

from server.bus.topics import PRESENCE, PRESENCE_HINTS

PRESENCE_NAMESPACE = "ap:{presence}:"
"""Every presence key and channel shares the ``{presence}`` hash tag: one Redis
Cluster slot, so the writer's Lua scripts can touch all of them and publish."""


def channel_for(topic: str) -> str:
    """The Redis channel of a bus topic.

    Presence channels live under the ``{presence}`` hash tag with the presence
    keys. Every other topic is its own hash tag (``ap:{game:chess#g1}``), so
    under sharded pub/sub each game is one slot, spread over the shards, and
    any per-game key added later (``ap:{game:chess#g1}:log``) lands beside it.
    """
    if topic == PRESENCE:
        return PRESENCE_NAMESPACE + "deltas"
    if topic == PRESENCE_HINTS:
        return PRESENCE_NAMESPACE + "hints"
    return "ap:{" + topic + "}"
