"""In-process bus: the embedded default, and nodes sharing one process in tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from server.bus.base import MessageHandler


class MemoryHub:
    """Connects the memory buses of one process, like one Redis would."""

    def __init__(self) -> None:
        self.subscribers: dict[str, set[MemoryBus]] = {}
        # Stream positions and history (server.bus.streams.MemoryStreams), shared
        # by every MemoryStreams on this hub as Redis keys are by every node.
        self.streams: dict[str, Any] = {}
        self.event_ids: dict[Any, Any] = {}


class MemoryBus:
    def __init__(self, hub: MemoryHub | None = None) -> None:
        self._hub = hub if hub is not None else MemoryHub()
        self._handler: MessageHandler | None = None
        self._topics: set[str] = set()
        # Its loop, held from start: asyncio.get_running_loop() costs a getpid()
        # system call on CPython 3.11, and this runs once per event.
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def hub(self) -> MemoryHub:
        return self._hub

    @property
    def connected(self) -> bool:
        return self._handler is not None

    @property
    def serving(self) -> bool:
        return self.connected

    async def start(self, handler: MessageHandler) -> None:
        self._handler = handler
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        await self.unsubscribe(list(self._topics))
        self._handler = None

    async def publish(self, topic: str, data: bytes, *, local_fallback: bool = True) -> None:
        # One process: every node is reachable, there is nothing to fall back from.
        self.publish_now(topic, data)

    def publish_now(self, topic: str, data: bytes) -> None:
        """``publish`` without a suspension point, for callers that must not yield."""
        loop = self._loop or asyncio.get_running_loop()
        for bus in self._hub.subscribers.get(topic, ()):
            # Deliver on a later loop turn, in order, as a network bus would.
            loop.call_soon(bus._deliver, topic, data)

    def _deliver(self, topic: str, data: bytes) -> None:
        if self._handler is not None and topic in self._topics:
            self._handler(topic, data)

    async def subscribe(self, topics: Iterable[str]) -> None:
        for topic in topics:
            self._topics.add(topic)
            self._hub.subscribers.setdefault(topic, set()).add(self)

    async def unsubscribe(self, topics: Iterable[str]) -> None:
        for topic in topics:
            self._topics.discard(topic)
            subscribers = self._hub.subscribers.get(topic)
            if subscribers is not None:
                subscribers.discard(self)
                if not subscribers:
                    del self._hub.subscribers[topic]
