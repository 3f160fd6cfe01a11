"""One write per socket per loop turn: the frames a socket gets in one turn leave
together, in order, and nothing written after a close frame."""

from __future__ import annotations

from protocol.codec import Frame
from protocol.errors import CloseCode, ErrorCode
from protocol.messages import GameEvent, Positioned
from protocol.streams import game_stream
from server.session import Session, send_frame, send_frames
from tests.client import Client
from tests.conftest import RunningServer

LIMIT = 1024 * 1024


def event(meta: str, game_id: str, n: int) -> Frame:
    game = GameEvent("game", meta, game_id, {"meta": meta, "id": game_id, "n": n})
    return Frame(Positioned(game, game_stream(game.key), "e", n))


def session_of(server: RunningServer, user_id: str) -> Session:
    (session,) = [s for s in server.node.sessions if s.user_id == user_id]
    return session


def numbers(client: Client) -> list[int]:
    return [m["payload"]["n"] for m in client.of_verb("game")]


async def test_the_frames_of_one_turn_leave_in_one_write_per_socket_in_order(
    server: RunningServer,
) -> None:
    alice = await server.subscribed("alice", games=[("chess", "g1")], wants_presence=False)
    bob = await server.subscribed("bob", games=[("chess", "g1")], wants_presence=False)
    a, b = session_of(server, "alice"), session_of(server, "bob")
    traffic = server.node.traffic
    writes, frames = traffic.socket_writes, traffic.frames_sent
    # One synchronous block: one loop turn. Bob gets a replay of two in the middle.
    assert send_frame([a, b], event("chess", "g1", 1), LIMIT) == 2
    assert send_frames(b, [event("chess", "g1", 2), event("chess", "g1", 3)], LIMIT)
    assert send_frame([b, a], event("chess", "g1", 4), LIMIT) == 2
    assert traffic.socket_writes == writes  # nothing written before the turn ends
    await bob.next_message(lambda m: m.get("payload", {}).get("n") == 4)
    await alice.next_message(lambda m: m.get("payload", {}).get("n") == 4)
    assert numbers(alice) == [1, 4]
    assert numbers(bob) == [1, 2, 3, 4]
    assert traffic.socket_writes - writes == 2
    assert traffic.frames_sent - frames == 6


async def test_a_close_writes_the_turns_frames_before_the_close_frame(
    server: RunningServer,
) -> None:
    alice = await server.subscribed("alice", games=[("chess", "g1")], wants_presence=False)
    session = session_of(server, "alice")
    send_frame([session], event("chess", "g1", 1), LIMIT)
    session.send_error(ErrorCode.RATE_LIMITED, "last words", LIMIT)
    session.close(CloseCode.POLICY_VIOLATION, "going")
    assert await alice.closed() == (CloseCode.POLICY_VIOLATION, "going")
    assert numbers(alice) == [1]
    assert [m["payload"]["message"] for m in alice.of_verb("error")] == ["last words"]


async def test_frames_of_a_session_closed_in_the_same_turn_are_not_sent_after_it(
    server: RunningServer,
) -> None:
    alice = await server.subscribed("alice", games=[("chess", "g1")], wants_presence=False)
    session = session_of(server, "alice")
    send_frame([session], event("chess", "g1", 1), LIMIT)
    session.close(CloseCode.POLICY_VIOLATION, "going")
    assert send_frame([session], event("chess", "g1", 2), LIMIT) == 0
    assert session.pending is None
    assert await alice.closed() == (CloseCode.POLICY_VIOLATION, "going")
    assert numbers(alice) == [1]
