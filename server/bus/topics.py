"""Bus topics. Implementations map each topic to their own channel names."""

from __future__ import annotations

from protocol.messages import GameKey
from protocol.streams import stream_game

GAME_PREFIX = "game:"
ALL_GAMES = "games"
"""Every game event, for nodes that hold legacy (watch-everything) connections."""
ADMIN = "admin"
"""``test`` broadcasts, for every node."""
PRESENCE = "presence"
"""Committed presence deltas, in seq order, for every node."""
PRESENCE_HINTS = "presence-hints"
"""Users whose presence changed on some node, for the presence writer."""

NODE_TOPICS = (ADMIN, PRESENCE, PRESENCE_HINTS)
"""Topics every node subscribes to for its whole life."""


def game_topic(key: GameKey) -> str:
    return GAME_PREFIX + key


def stream_topic(stream: str) -> str:
    """The topic a stream's events arrive on (a user stream's is its own name)."""
    key = stream_game(stream)
    return game_topic(key) if key is not None else stream
