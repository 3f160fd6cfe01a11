"""Domain services the node owns (bots, chat, lastSeen, notifications, ...), each behind the store
and bus interfaces, with memory parts for the embedded default and Redis parts for a cluster."""

from __future__ import annotations

from typing import Protocol


class Service(Protocol):
    """A part the node starts after itself and stops before itself."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
