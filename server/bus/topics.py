"""Bus topics. Implementations map each topic to their own channel names."""

from __future__ import annotations

from protocol.messages import GameKey

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
