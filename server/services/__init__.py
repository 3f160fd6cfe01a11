"""Domain services the node owns (bots, chat, lastSeen, notifications, ...), each behind the store
and bus interfaces, with memory parts for the embedded default and Redis parts for a cluster.

A service gets what it needs of the hub as callables (``publish``, ``watch``), never the node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from server.coordination.claims import Claims
from server.coordination.game_lock import GameLocks
from server.coordination.rate_limit import RateLimiter


class Service(Protocol):
    """A part the node starts after itself and stops before itself."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class Coordination:
    """What the services share across nodes: Redis parts in a cluster, memory alone
    (``server.wiring`` chooses)."""

    game_locks: GameLocks
    chat_limiter: RateLimiter
    last_seen_claims: Claims
