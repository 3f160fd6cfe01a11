"""Drain on one node: not ready at once, then 1012 for every client, spread out in time.

The cluster test (tests/cluster/test_drain.py) rolls a node of two with 1,000
clients and checks presence and events across the move.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from server.session import DRAIN_BATCH_SECONDS
from tests.client import Client
from tests.conftest import RunningServer

CLIENTS = 40
SECONDS = 1.5


@pytest.mark.parametrize("server", [{"drain_move_grace_ms": 300}], indirect=True)
async def test_drain_is_not_ready_at_once_and_closes_everyone_with_1012_spread_out(
    server: RunningServer,
) -> None:
    clients = [await server.subscribed(f"u{i}") for i in range(CLIENTS)]
    closed_at: dict[int, float] = {}

    async def watch(i: int, client: Client) -> int | None:
        code, _ = await client.closed(within=SECONDS + 60)
        closed_at[i] = time.monotonic()
        return code

    watchers = [asyncio.create_task(watch(i, c)) for i, c in enumerate(clients)]
    started = time.monotonic()
    drain = asyncio.create_task(server.node.drain(SECONDS))
    await asyncio.sleep(0)
    status, body = await server.http("GET", "/readyz", secret=None)
    assert status == 503 and isinstance(body, dict) and body["started"] is False

    codes = await asyncio.gather(*watchers)
    assert await drain == CLIENTS
    assert set(codes) == {1012}
    # Spread out: the last batch closes in the window's last slice, never sooner
    # (a lower bound, whatever the load: the drain sleeps until its moment).
    batches = min(CLIENTS, round(SECONDS / DRAIN_BATCH_SECONDS))
    assert batches > 1
    assert max(closed_at.values()) - started >= SECONDS * (batches - 1) / batches
    # Each drained user is withdrawn only after the move grace, then for good.
    assert server.node.presence.local.user_count == 0
    assert server.node.sessions == set()


async def test_drain_with_no_clients_returns_at_once(server: RunningServer) -> None:
    # Had it waited out the drain's 10 minutes, the deadline would end it.
    assert await asyncio.wait_for(server.node.drain(600), 60) == 0
