"""What the fan-out reads of websockets beyond its documented API, pinned here so
that an upgrade that changes it fails a test instead of the node."""

from __future__ import annotations

import asyncio

from websockets.protocol import State
from websockets.server import ServerProtocol

from protocol.codec import Frame
from protocol.messages import GameEvent
from server.session import Session, send_frame
from tests.conftest import RunningServer


def test_protocol_state_is_the_state_attribute() -> None:
    # TurnWrites.flush reads ``protocol._state`` for ``protocol.state``.
    protocol = ServerProtocol()
    for state in State:
        protocol.state = state
        assert protocol._state is state
        assert protocol.state is state


def session_of(server: RunningServer, user_id: str) -> Session:
    (session,) = [s for s in server.node.sessions if s.user_id == user_id]
    return session


async def test_the_transports_pauses_are_mirrored_on_the_session(server: RunningServer) -> None:
    await server.subscribed("alice", wants_presence=False)
    session = session_of(server, "alice")
    ws = session.ws
    assert session.write_paused is False  # attached: it follows the transport from here
    # Below the high-water mark an unpaused socket cannot be over the outbox limit.
    high = ws.transport.get_write_buffer_limits()[1]
    assert high == ws.write_limit_high
    assert session.unpaused_most == high + session.kernel_capacity
    assert session.unpaused_most <= server.node.settings.outbox_limit_bytes
    ws.pause_writing()  # what the transport calls past the high-water mark
    assert ws.paused and session.write_paused
    ws.resume_writing()
    assert not ws.paused and not session.write_paused


async def test_a_client_that_stops_reading_gets_its_session_paused(server: RunningServer) -> None:
    client = await server.subscribed("bob", games=[("chess", "g1")], wants_presence=False)
    session = session_of(server, "bob")
    client.ws.transport.pause_reading()  # the client's kernel buffers fill, then ours
    big = Frame(
        GameEvent("game", "chess", "g1", {"meta": "chess", "id": "g1", "pad": "x" * 60_000})
    )
    for _ in range(200):
        send_frame([session], big, 100 * 1024 * 1024)
        await asyncio.sleep(0)
        if session.write_paused:
            break
    assert session.write_paused and session.ws.paused
    client.ws.transport.resume_reading()
