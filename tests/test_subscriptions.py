"""Batched subscribes (server/routing/subscribe_batching.py): over a real Redis bus, and a
MemoryBus that records its calls and can hold one out."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

import pytest

from server.bus import MemoryBus
from server.bus.redis_bus import RedisBus
from server.routing.subscribe_batching import SubscribeBatcher
from tests.contract.test_bus_contract import Receiver
from tests.services import redis_url_for_tests
from tests.waiting import eventually


class CountingBus(MemoryBus):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.fail: Exception | None = None

    async def subscribe(self, topics: Iterable[str]) -> None:
        self.calls.append(list(topics))
        await self.hold.wait()
        if self.fail is not None:
            raise self.fail
        await super().subscribe(topics)


async def test_callers_of_one_turn_share_one_call() -> None:
    bus = CountingBus()
    batcher = SubscribeBatcher(bus)
    await asyncio.gather(
        batcher.subscribe(["game:a", "user:1"]),
        batcher.subscribe(["game:a", "user:2"]),
        batcher.subscribe([]),
    )
    assert bus.calls == [["game:a", "user:1", "user:2"]]


async def test_a_caller_returns_only_after_a_call_that_named_its_topics() -> None:
    bus = CountingBus()
    batcher = SubscribeBatcher(bus)
    bus.hold.clear()
    first = asyncio.create_task(batcher.subscribe(["user:1"]))
    await eventually(lambda: len(bus.calls) == 1, 30, "the first call out")
    second = asyncio.create_task(batcher.subscribe(["user:2"]))
    third = asyncio.create_task(batcher.subscribe(["user:3"]))
    await asyncio.sleep(0.01)
    assert bus.calls == [["user:1"]] and not second.done()
    bus.hold.set()
    await asyncio.gather(first, second, third)
    assert bus.calls == [["user:1"], ["user:2", "user:3"]]


async def test_an_error_reaches_every_caller_of_its_call_and_the_next_call_goes_out() -> None:
    bus = CountingBus()
    batcher = SubscribeBatcher(bus)
    bus.fail = ConnectionError("bus away")
    results = await asyncio.gather(
        batcher.subscribe(["user:1"]), batcher.subscribe(["user:2"]), return_exceptions=True
    )
    assert all(isinstance(r, ConnectionError) for r in results)
    bus.fail = None
    await batcher.subscribe(["user:3"])
    assert bus.calls[-1] == ["user:3"]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_url_for_tests() as url:
        yield url


async def test_on_redis_every_caller_hears_its_topics_when_it_returns(redis_url: str) -> None:
    listener = RedisBus(redis_url)
    inbox = Receiver(listener)
    publisher = RedisBus(redis_url)
    await listener.start(inbox)
    await publisher.start(lambda topic, data: None)
    batcher = SubscribeBatcher(listener)
    try:
        topics = [f"user:batch-{i}" for i in range(50)]
        await asyncio.gather(*(batcher.subscribe([topic]) for topic in topics))
        for topic in topics:
            await publisher.publish(topic, topic.encode())
        for topic in topics:
            await inbox.wait_count(topic, 1)
            assert inbox.on(topic) == [topic.encode()]
    finally:
        await batcher.close()
        await publisher.close()
        await listener.close()
