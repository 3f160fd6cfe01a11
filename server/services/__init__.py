"""Domain services the node owns (bots, chat, lastSeen, notifications, ...), each behind the store
and bus interfaces, with memory parts for the embedded default and Redis parts for a cluster.

A service gets what it needs of the hub as callables (``publish``, ``watch``), never the node."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from protocol.messages import Broadcast, GameKey, Position, Since
from server.bus.streams import Fence
from server.coordination.bot_sessions import BotSessions
from server.coordination.claims import Claims
from server.coordination.game_lock import GameLocks
from server.coordination.rate_limit import RateLimiter
from server.session import Session


class Service(Protocol):
    """A part the node starts after itself and stops before itself."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Publish(Protocol):
    """The hub's one door for events (``Node.publish``): the positions taken, per stream."""

    async def __call__(
        self,
        message: Broadcast,
        *,
        require_cluster: bool = False,
        event_id: str | None = None,
        then: Sequence[tuple[Broadcast, str]] = (),
        fence: Fence | None = None,
    ) -> dict[str, Position]: ...


class Watch(Protocol):
    """A session's new watch set (``Node.watch``), recovering ``since`` if given;
    False when it was refused (the old set stays)."""

    async def __call__(
        self, session: Session, games: frozenset[GameKey], since: Since | None = None
    ) -> bool: ...


@dataclass(frozen=True)
class Coordination:
    """What the services share across nodes: Redis parts in a cluster, memory alone
    (``server.wiring`` chooses)."""

    game_locks: GameLocks
    chat_limiter: RateLimiter
    last_seen_claims: Claims
    bot_sessions: BotSessions
