"""The bus interface: how envelopes reach every interested node.

Two implementations share one contract suite (``tests/contract``): the
in-process bus of the embedded default, and Redis pub/sub across nodes.
Delivery is at most once and in publish order per topic; nodes repair the
rest (presence seq gaps resync, events are hints to refetch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

MessageHandler = Callable[[str, bytes], None]
"""Called with (topic, data) for each message, on the event loop, in order."""


class BusDown(ConnectionError):
    """The bus could not take an event for every node (raised only when asked to)."""


class Bus(Protocol):
    @property
    def connected(self) -> bool:
        """False while the bus cannot deliver across nodes."""

    @property
    def serving(self) -> bool:
        """False while this node cannot serve its clients (``/readyz`` 503)."""

    async def start(self, handler: MessageHandler) -> None:
        """Connect and start delivering messages of subscribed topics to ``handler``."""

    async def close(self) -> None: ...

    async def publish(self, topic: str, data: bytes, *, local_fallback: bool = True) -> None:
        """Send ``data`` to every node subscribed to ``topic``, this one included.

        While the bus cannot reach the other nodes it delivers to this node only;
        with ``local_fallback=False`` it raises :class:`BusDown` instead, for callers
        that keep the event (a queue message) and try again later.
        """

    async def subscribe(self, topics: Iterable[str]) -> None: ...

    async def unsubscribe(self, topics: Iterable[str]) -> None: ...
