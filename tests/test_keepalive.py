"""The node-wide keepalive sweep, on real sessions: who is pinged, who is closed."""

from __future__ import annotations

import asyncio

import pytest

from protocol.errors import CloseCode
from server.routing.keepalive import PING, sweep
from tests.conftest import RunningServer

# Pings only from the sweeps these tests make: the node's own come a minute apart.
QUIET = {"ping_interval": 60.0, "ping_timeout": 60.0}


@pytest.mark.parametrize("server", [QUIET], indirect=True)
async def test_a_due_session_is_pinged_once_and_a_silent_one_closed_with_1011(
    server: RunningServer,
) -> None:
    alice = await server.subscribed("alice", wants_presence=False)
    (session,) = [s for s in server.node.sessions if s.user_id == "alice"]
    now = asyncio.get_running_loop().time()
    session.heard_at = session.pinged_at = now - 10
    assert sweep(server.node.sessions, now, 5.0, 5.0) == 1  # due: pinged
    assert session.pinged_at == now
    assert sweep(server.node.sessions, now + 1, 5.0, 5.0) == 0  # waiting for its pong
    # The client's library answers: the node hears it.
    await asyncio.sleep(0.1)
    await alice.barrier()
    assert session.heard_at >= now
    # Silent past the timeout after a ping: closed as websockets would close it.
    session.heard_at = now - 1
    assert sweep(server.node.sessions, now + 6, 5.0, 5.0) == 0
    assert session.close_task is not None
    assert await alice.closed() == (CloseCode.INTERNAL_ERROR, "keepalive ping timeout")


def test_the_ping_is_what_websockets_frames() -> None:
    from websockets.frames import Frame, Opcode

    assert Frame(Opcode.PING, b"").serialize(mask=False, extensions=[]) == PING
