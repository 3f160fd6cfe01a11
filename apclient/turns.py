"""Which notifications are a bot's turns: each game once per ply. No I/O.

A bot learns that it must move in a game from ``pendingTurns`` (every game
where it is to move, after each subscribe) and from ``yourTurn`` events. The
same ply is often named more than once: a turn published around a subscribe is
in both, every reconnect lists again the games the bot has not moved in yet, and
the backend re-sends a turn (an admin's ``ping_bot``).

Exact where the data allows: a turn that carries its ply (``numMoves``, else
``lastMoveTime``, as in the game's summary row) is a new turn only when that ply
is later than the last one handed out for the game; an equal or older one is a
repeat, whatever happened in the game meanwhile.

Otherwise (today's ``{meta, id}``), a game is a turn again only once something
happened in it since it was last one: a frame on its stream (a move, a comment,
the bot's own move as a ``skip``), or a resync of that stream. A bot watches all
its current games, so its own move always shows there. A comment in between can
then make a repeat look new, which is why a bot without plies still checks the
move number before it moves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from protocol.messages import Ply, game_key
from protocol.streams import stream_game

GameRef = tuple[str, str]
Candidate = tuple[GameRef, Ply | None]


def later(ply: Ply, than: Ply) -> bool | None:
    """Whether ``ply`` comes after ``than``; None when they share no measure."""
    if ply.moves is not None and than.moves is not None:
        return ply.moves > than.moves
    if ply.time is not None and than.time is not None:
        return ply.time > than.time
    return None


@dataclass(slots=True)
class _Game:
    ply: Ply | None = None  # of the last turn handed out, when it named one
    quiet: bool = True  # nothing happened in the game since that turn


class TurnTracker:
    def __init__(self) -> None:
        self._games: dict[str, _Game] = {}

    def offer(self, games: Iterable[Candidate]) -> list[Candidate]:
        """The games among ``games`` (from pendingTurns or a yourTurn, each with its
        ply when known) that are new turns."""
        turns: list[Candidate] = []
        for ref, ply in games:
            key = game_key(*ref)
            game = self._games.get(key)
            if game is None:
                self._games[key] = _Game(ply)
                turns.append((ref, ply))
                continue
            newer = later(ply, game.ply) if ply is not None and game.ply is not None else None
            if newer is None:
                # no common measure: the heuristic decides, and a known ply is kept
                newer = not game.quiet
                if not newer and ply is not None:
                    game.ply = ply  # the turn handed out was this one
            if newer:
                game.ply, game.quiet = ply, True
                turns.append((ref, ply))
        return turns

    def changed(self, stream: str) -> None:
        """A frame or a resync on ``stream``: its game may be a turn again."""
        key = stream_game(stream)
        game = self._games.get(key) if key is not None else None
        if game is not None:
            game.quiet = False
