"""Domain services the node owns: each behind the store and bus interfaces."""

from __future__ import annotations

from typing import Protocol


class Service(Protocol):
    """A part the node starts after itself and stops before itself."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
