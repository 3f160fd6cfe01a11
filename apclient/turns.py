"""Which notifications are a bot's turns: each game once per ply. No I/O.

A bot learns that it must move in a game from ``pendingTurns`` (every game
where it is to move, after each subscribe) and from ``yourTurn`` events. The
same ply is often named twice: a turn published around a subscribe is in both,
and every reconnect lists again the games the bot has not moved in yet. A game
is therefore a turn again only once something happened in it since it was last
one: a frame on its stream (a move, a comment, the bot's own move as a
``skip``), or a resync of that stream. A bot watches all its current games, so
its own move always shows there.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.messages import game_key
from protocol.streams import stream_game

GameRef = tuple[str, str]


class TurnTracker:
    def __init__(self) -> None:
        self._current: set[str] = set()  # game keys handed out with nothing new since

    def offer(self, games: Iterable[GameRef]) -> list[GameRef]:
        """The games among ``games`` (from pendingTurns or a yourTurn) that are new turns."""
        turns: list[GameRef] = []
        for meta, game_id in games:
            key = game_key(meta, game_id)
            if key not in self._current:
                self._current.add(key)
                turns.append((meta, game_id))
        return turns

    def changed(self, stream: str) -> None:
        """A frame or a resync on ``stream``: its game may be a turn again."""
        key = stream_game(stream)
        if key is not None:
            self._current.discard(key)
