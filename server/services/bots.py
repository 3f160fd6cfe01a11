"""Bots as WebSocket clients: who may connect, and which games wait for their move.

A bot proves who it is with an access token of the bot pool (``server.auth.verify``);
here it must also have a ``BOT`` row, and may hold at most
``--bot-max-connections`` sockets on one node. Right after it subscribes, it is
told every current game where it is to move (``pendingTurns``) and watches
those games, so a bot that was away learns everything it missed without any
call of its own.

Where the games come from: production writes ``CURRENTGAMES#`` rows for humans
only (its projector skips bots, and is off by default), so every ``move``
message of the bot queue also leaves its game as a candidate
(``BOTTURNS#<botId>``, written by ``server.ingress.bot_queue``). At subscribe
the candidates' ``GAME`` rows say, by ``toMove``, which games wait for the bot
now; candidates that are over or not the bot's turn are pruned, once they are
older than ``PRUNE_GRACE_MS`` (the backend enqueues a move message before its
game write lands). ``CURRENTGAMES#`` rows, where a deployment has them, count too.

The service also marks, cluster-wide, that this node serves the bot
(``server.coordination.bot_sessions``), before it reads the candidates: the
bridge writes a candidate before it looks at the marks, so a turn forwarded to
the webhook just before the bot connected is in this list.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from contextlib import AsyncExitStack

from protocol.codec import Frame
from protocol.errors import MAX_WATCHED_GAMES, CloseCode, ErrorCode
from protocol.messages import GameKey, PendingTurns, game_key
from protocol.streams import user_stream
from server.coordination.bot_sessions import MARK_SECONDS, BotSessions, MemoryBotSessions
from server.runtime.metrics import Registry
from server.runtime.tasks import run_until_unwound
from server.services import Watch
from server.session import Session
from server.store.base import BotCandidate, CurrentGame, Store, StoreUnavailable

log = logging.getLogger(__name__)

KNOWN_BOT_CACHE_SECONDS = 60.0
"""How long a found ``BOT`` row is trusted: a deleted bot is locked out within a minute."""

UNKNOWN_BOT_CACHE_SECONDS = 5.0
"""How long a missing ``BOT`` row is remembered: short, so a newly created bot
can connect at once, yet a reconnect loop of an unknown bot costs one read per 5 s."""

PRUNE_GRACE_MS = 120_000
"""A candidate younger than this is kept even when its game is not (yet) the bot's
turn: the backend enqueues the move message before it writes the game."""


def is_to_move(game: CurrentGame, player_id: str) -> bool:
    """Whether ``player_id`` must move in ``game``.

    ``toMove`` is the index of the player to move, as a string, or for
    simultaneous games one flag per player, in the order of ``players``.
    """
    players = game.player_ids
    to_move = game.to_move
    if isinstance(to_move, str):
        try:
            index = int(to_move)
        except ValueError:
            return False
        return 0 <= index < len(players) and players[index] == player_id
    if isinstance(to_move, tuple):
        return any(
            flag and index < len(players) and players[index] == player_id
            for index, flag in enumerate(to_move)
        )
    return False


class BotService:
    """Admission and pending turns of bot connections on one node.

    Of the hub it gets callables: ``subscribe`` (bus topics, heard once the call
    returns), ``watch`` (a session's new watch set) and ``is_open`` (whether a
    session is still connected).
    """

    def __init__(
        self,
        store: Store,
        max_connections: int,
        outbox_limit: int,
        *,
        subscribe: Callable[[Iterable[str]], Awaitable[None]],
        watch: Watch,
        is_open: Callable[[Session], bool],
        clock: Callable[[], float] = time.monotonic,
        metrics: Registry | None = None,
        sessions: BotSessions | None = None,
    ) -> None:
        registry = metrics or Registry()
        self._refusals = registry.counter("ap_bot_refusals_total", "Bot subscribes refused")
        self._pending_sent = registry.counter(
            "ap_bot_pending_turns_total", "pendingTurns frames sent to bots"
        )
        self._store = store
        self._subscribe = subscribe
        self._watch = watch
        self._is_open = is_open
        self._max_connections = max_connections
        self._outbox_limit = outbox_limit
        self._clock = clock
        self._known: dict[str, tuple[float, bool]] = {}  # bot id -> (expires at, has a row)
        self._pruned = registry.counter(
            "ap_bot_candidates_pruned_total", "BOTTURNS# candidates dropped: over or not to move"
        )
        self._sessions = sessions if sessions is not None else MemoryBotSessions()
        self._held: dict[str, set[Session]] = {}  # bot id -> its sessions on this node
        self._unmarking: set[asyncio.Task[None]] = set()

    @property
    def sessions(self) -> BotSessions:
        """The cluster-wide marks of bots with a session (the bot queue bridge reads them)."""
        return self._sessions

    def start(self, stack: AsyncExitStack) -> None:
        """Renew this node's marks of its bots until the node stops, then drop them."""
        run_until_unwound(stack, self._renew_marks(), "bot-marks")

    async def _renew_marks(self) -> None:
        try:
            while True:
                await asyncio.sleep(MARK_SECONDS / 3)
                for sessions in list(self._held.values()):
                    for session in [s for s in sessions if not self._is_open(s)]:
                        self.left(session)  # closed before its subscribe was done
                if self._held:
                    try:
                        await self._sessions.mark(list(self._held))
                    except Exception as exc:
                        log.warning("bot session marks not renewed: %s", exc)
        finally:
            # The sessions closed just before this: the unmarks they started go first.
            if self._unmarking:
                await asyncio.wait(list(self._unmarking), timeout=1.0)
            for bot_id in list(self._held):
                try:
                    await asyncio.wait_for(self._sessions.unmark(bot_id), 1.0)
                except Exception:
                    break  # they lapse on their own within MARK_SECONDS

    def left(self, session: Session) -> None:
        """A bot's subscribed session closed: drop the mark with its last one here."""
        bot_id = session.user_id
        held = self._held.get(bot_id) if bot_id is not None else None
        if bot_id is None or held is None:
            return
        held.discard(session)
        if held:
            return
        del self._held[bot_id]
        task = asyncio.create_task(self._unmark(bot_id), name="bot-unmark")
        self._unmarking.add(task)
        task.add_done_callback(self._unmarking.discard)

    async def _unmark(self, bot_id: str) -> None:
        try:
            if bot_id not in self._held:  # not back meanwhile
                await self._sessions.unmark(bot_id)
        except Exception as exc:
            log.info("bot %s: mark not dropped (it lapses): %s", bot_id, exc)

    async def known(self, bot_id: str) -> bool:
        """Whether the bot has a ``BOT`` row, from a short cache (raises StoreUnavailable)."""
        now = self._clock()
        cached = self._known.get(bot_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        found = await self._store.get_bot(bot_id) is not None
        ttl = KNOWN_BOT_CACHE_SECONDS if found else UNKNOWN_BOT_CACHE_SECONDS
        if len(self._known) > 10_000:
            self._known = {k: v for k, v in self._known.items() if v[0] > now}
        self._known[bot_id] = (now + ttl, found)
        return found

    async def admit(
        self, session: Session, bot_id: str, connections: Callable[[], Collection[Session]]
    ) -> bool:
        """Check the ``BOT`` row and the connection limit; on refusal send the error,
        close the socket and return False. ``connections`` gives the bot's subscribed
        sessions on this node, read after the row check so concurrent subscribes count."""
        try:
            found = await self.known(bot_id)
        except StoreUnavailable as exc:
            log.warning("bot %s: BOT row unreadable: %s", bot_id, exc)
            return self._refuse(
                session,
                ErrorCode.UNAVAILABLE,
                "the bot registry cannot be read right now; reconnect later",
                CloseCode.TRY_AGAIN_LATER,
            )
        if not found:
            return self._refuse(
                session,
                ErrorCode.UNAUTHORIZED,
                f"no bot is registered with client id {bot_id!r}",
                CloseCode.POLICY_VIOLATION,
            )
        others = [s for s in connections() if s is not session]
        if len(others) >= self._max_connections:
            return self._refuse(
                session,
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"this bot already has {len(others)} connections to this server "
                f"(at most {self._max_connections})",
                CloseCode.TOO_MANY_CONNECTIONS,
            )
        return True

    def _refuse(self, session: Session, code: ErrorCode, message: str, close: CloseCode) -> bool:
        self._refusals.inc()
        session.send_error(code, message, self._outbox_limit)
        session.close(close, code.value)
        return False

    async def send_pending_turns(self, session: Session) -> None:
        """Watch every current game of the bot and send ``pendingTurns``."""
        bot_id = session.user_id
        assert bot_id is not None
        try:
            # Hear the bot's user stream before reading its games: a turn published
            # after the read then arrives live, one published before is in the rows.
            await self._subscribe([user_stream(bot_id)])
        except Exception as exc:
            log.warning("bot %s: user stream subscription failed: %s", bot_id, exc)
        self._held.setdefault(bot_id, set()).add(session)
        try:
            await self._sessions.mark([bot_id])
        except Exception as exc:
            # The bridge may forward this bot's messages meanwhile: its moves
            # are candidates, read below, and the mark is renewed soon.
            log.warning("bot %s: session mark failed: %s", bot_id, exc)
        if not self._is_open(session):
            self.left(session)  # it closed meanwhile: its close found no mark to drop
            return
        try:
            games = await self._store.current_games(bot_id)
            games += await self._candidate_turns(bot_id, {g.game_id for g in games})
        except StoreUnavailable as exc:
            log.warning("bot %s: current games unreadable: %s", bot_id, exc)
            # Without the list the bot could miss a turn forever: make it retry.
            self._refuse(
                session,
                ErrorCode.UNAVAILABLE,
                "your current games cannot be read right now; reconnect later",
                CloseCode.TRY_AGAIN_LATER,
            )
            return
        if not self._is_open(session) or session.user_id != bot_id:
            return  # closed (or taken over) while the games were read
        watched = watch_set(session.watching, games)
        if watched != session.watching:
            await self._watch(session, watched)
            if not self._is_open(session):
                return
        pending = tuple((g.meta, g.game_id) for g in games if is_to_move(g, bot_id))
        self._pending_sent.inc()
        session.send(Frame(PendingTurns(games=pending)), self._outbox_limit)

    async def _candidate_turns(self, bot_id: str, known: set[str]) -> list[CurrentGame]:
        """The candidates' active games where the bot is to move; prunes the rest."""
        candidates = [c for c in await self._store.bot_candidates(bot_id) if c.game_id not in known]
        if not candidates:
            return []
        active = await self._store.active_games([(c.meta, c.game_id) for c in candidates])
        turns: list[CurrentGame] = []
        stale: list[BotCandidate] = []
        now_ms = int(time.time() * 1000)
        for candidate in candidates:
            game = active.get(candidate.game_id)
            if game is not None and is_to_move(game, bot_id):
                turns.append(game)
            elif now_ms - candidate.added_at_ms >= PRUNE_GRACE_MS:
                stale.append(candidate)
        for candidate in stale:
            try:
                # Conditional on addedAt: a message that named the game meanwhile wins.
                if await self._store.drop_bot_candidate(
                    bot_id, candidate.game_id, candidate.added_at_ms
                ):
                    self._pruned.inc()
            except StoreUnavailable as exc:
                log.info("bot %s: candidate %s not pruned: %s", bot_id, candidate.game_id, exc)
                break
        return turns


def watch_set(watching: frozenset[GameKey], games: list[CurrentGame]) -> frozenset[GameKey]:
    """The bot's own watch set plus its current games, within the per-connection cap."""
    keys = set(watching)
    for game in games:
        if len(keys) >= MAX_WATCHED_GAMES:
            log.warning("bot is in more than %d games; watching the first ones", MAX_WATCHED_GAMES)
            break
        keys.add(game_key(game.meta, game.game_id))
    return frozenset(keys)
