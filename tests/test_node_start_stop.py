"""The node's own life: parts start in order, stop in reverse, and a start that
fails or is cancelled half-way closes exactly what it started.

The parts are the real embedded ones; each start and close is recorded on its
way through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from server.node import Node
from server.wiring import build_node
from tests.conftest import TEST_SETTINGS

# Every part with a start of its own, in the order the node starts them.
STARTED = [
    "store",
    "presence_backend",
    "streams",
    "bus",
    "registry",
    "topics",
    "last_seen",
    "chat_marks",
]
# Every close, in the order a full stop runs them.
CLOSED = [
    "chat_marks", "last_seen", "chat", "topics", "registry", "history", "recovery",
    "bus", "streams", "presence_backend", "authenticator", "store",
]  # fmt: skip


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def of(self, what: str) -> list[str]:
        return [name for kind, name in self.events if kind == what]


def parts(node: Node) -> dict[str, Any]:
    return {
        "store": node.store,
        "authenticator": node.authenticator,
        "presence_backend": node.presence_backend,
        "streams": node.streams,
        "bus": node.bus,
        "registry": node.registry,
        "topics": node.index.topics,
        "last_seen": node.last_seen,
        "chat_marks": node.chat_marks,
        "chat": node.chat,
        "history": node.history,
        "recovery": node.recovery,
    }


def record(node: Node, log: Log) -> None:
    """Wrap each part's start and close (the instance's own attribute) to log it."""
    for name, part in parts(node).items():
        for method in ("start", "close"):
            original = getattr(part, method, None)
            if original is not None:
                setattr(part, method, logged(log, method, name, original))


def logged(log: Log, method: str, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        log.events.append((method, name))
        return original(*args)

    return call


class RecordedService:
    def __init__(self, log: Log) -> None:
        self.log = log

    async def start(self) -> None:
        self.log.events.append(("start", "service"))

    async def stop(self) -> None:
        self.log.events.append(("close", "service"))


async def test_stop_closes_everything_started_once_and_in_reverse_order() -> None:
    log = Log()
    node = await build_node(TEST_SETTINGS)
    node.services.append(RecordedService(log))
    record(node, log)
    await node.start()
    assert node.ready
    assert log.of("start") == [*STARTED, "service"]
    await node.stop()
    assert not node.ready
    assert log.of("close") == ["service", *CLOSED]
    await node.stop()  # a second stop has nothing left to close
    assert log.of("close") == ["service", *CLOSED]


async def failing(*args: Any) -> None:
    raise ConnectionError("streams unreachable")


async def test_a_start_that_fails_closes_exactly_what_started() -> None:
    log = Log()
    node = await build_node(TEST_SETTINGS)
    node.services.append(RecordedService(log))
    record(node, log)
    node.streams.start = logged(log, "start", "streams (failing)", failing)  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await node.start()
    assert not node.ready
    assert log.of("start") == ["store", "presence_backend", "streams (failing)"]
    # The failing part closes what it may have opened; nothing after it is touched.
    assert log.of("close") == ["streams", "presence_backend", "authenticator", "store"]
    await node.stop()
    assert log.of("close") == ["streams", "presence_backend", "authenticator", "store"]


async def test_a_cancelled_start_closes_exactly_what_started() -> None:
    log = Log()
    node = await build_node(TEST_SETTINGS)
    record(node, log)
    entered = asyncio.Event()
    bus_start: Callable[..., Awaitable[None]] = node.bus.start

    async def slow_start(*args: Any) -> None:
        entered.set()
        await asyncio.Event().wait()  # never returns: cancelled from outside
        await bus_start(*args)

    node.bus.start = logged(log, "start", "bus (hanging)", slow_start)  # type: ignore[method-assign]
    starting = asyncio.create_task(node.start())
    await asyncio.wait_for(entered.wait(), timeout=10)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not node.ready
    assert log.of("start") == ["store", "presence_backend", "streams", "bus (hanging)"]
    assert log.of("close") == ["bus", "streams", "presence_backend", "authenticator", "store"]
