"""One write per socket per loop turn: the frames a socket gets in one turn leave
together, in order, and nothing written after a close frame."""

from __future__ import annotations

import asyncio

import pytest

from protocol.codec import Frame
from protocol.errors import CloseCode, ErrorCode
from protocol.messages import GameEvent, Positioned
from protocol.streams import game_stream
from server.session import HELD_FRAME_BYTES, HELD_FRAMES, Session, send_frame, send_frames
from tests.client import Client
from tests.conftest import RunningServer
from tests.waiting import eventually

LIMIT = 1024 * 1024


def event(meta: str, game_id: str, n: int) -> Frame:
    game = GameEvent("game", meta, game_id, {"meta": meta, "id": game_id, "n": n})
    return Frame(Positioned(game, game_stream(game.key), "e", n))


def session_of(server: RunningServer, user_id: str) -> Session:
    (session,) = [s for s in server.node.sessions if s.user_id == user_id]
    return session


async def watchers_of_g1(server: RunningServer, *users: str) -> list[tuple[Client, Session]]:
    """Clients watching g1, each with its session on the server."""
    clients = [
        await server.subscribed(user, games=[("chess", "g1")], wants_presence=False)
        for user in users
    ]
    return [(client, session_of(server, user)) for client, user in zip(clients, users, strict=True)]


def numbers(client: Client) -> list[int]:
    return [m["payload"]["n"] for m in client.of_verb("game")]


async def test_the_frames_of_one_turn_leave_in_one_write_per_socket_in_order(
    server: RunningServer,
) -> None:
    (alice, a), (bob, b) = await watchers_of_g1(server, "alice", "bob")
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


async def hold_for_an_hour(server: RunningServer) -> None:
    """No delayed flush comes due while a test looks."""
    turn = server.node.traffic.turn
    # A flush under way keeps the due time it has: let it finish first.
    await eventually(lambda: not turn.scheduled, 60, "the flush under way")
    turn.delay = 3600.0


async def alice_held(server: RunningServer) -> tuple[Client, Session]:
    """Alice, watching g1 on a node whose delayed flushes wait an hour."""
    ((alice, session),) = await watchers_of_g1(server, "alice")
    await hold_for_an_hour(server)
    return alice, session


def flush_counts(server: RunningServer) -> tuple[float, float]:
    """The node's flushes, and those held by the write delay, as ``/metrics`` shows them."""
    metrics = server.node.metrics
    return metrics.value("ap_write_flushes_total"), metrics.value("ap_write_flushes_held_total")


async def busy_turns(session: Session, numbers: range) -> None:
    """Frames in consecutive loop turns: a node still taking input each turn."""
    for n in numbers:
        assert send_frame([session], event("chess", "g1", n), LIMIT) == 1
        await asyncio.sleep(0)


@pytest.mark.parametrize("server", [{"write_delay_ms": 20}], indirect=True)
async def test_with_a_write_delay_a_caught_up_node_writes_at_once(server: RunningServer) -> None:
    alice = await server.subscribed("alice", games=[("chess", "g1")], wants_presence=False)
    assert server.node.traffic.turn.delay == 0.02  # from --write-delay-ms
    await hold_for_an_hour(server)
    flushes, held = flush_counts(server)
    send_frame([session_of(server, "alice")], event("chess", "g1", 1), LIMIT)
    # The next turn sends nothing: the flush does not wait out the hour.
    await alice.next_message(lambda m: m.get("payload", {}).get("n") == 1)
    after_flushes, after_held = flush_counts(server)
    assert after_flushes > flushes
    assert after_held == held  # what an operator sees: the delay did not apply


@pytest.mark.parametrize("server", [{"write_delay_ms": 20}], indirect=True)
async def test_with_a_write_delay_a_busy_nodes_frames_of_several_turns_share_one_write(
    server: RunningServer,
) -> None:
    alice, session = await alice_held(server)
    traffic = server.node.traffic
    writes, frames = traffic.socket_writes, traffic.frames_sent
    _, held = flush_counts(server)
    await busy_turns(session, range(1, 4))
    assert traffic.socket_writes == writes  # they wait out the delay
    assert flush_counts(server)[1] == held + 1  # counted as held while it waits
    # An answer to the client does not wait; the frames before it leave with it.
    assert send_frames(session, [event("chess", "g1", 4)], LIMIT)
    session.send_error(ErrorCode.RATE_LIMITED, "an answer", LIMIT)
    await alice.next_message(lambda m: m.get("verb") == "error")
    assert numbers(alice) == [1, 2, 3, 4]
    assert traffic.socket_writes - writes == 1
    assert traffic.frames_sent - frames == 5


@pytest.mark.parametrize("server", [{"write_delay_ms": 20}], indirect=True)
async def test_with_a_write_delay_held_frames_leave_when_it_is_over(
    server: RunningServer,
) -> None:
    (alice, a), (bob, b) = await watchers_of_g1(server, "alice", "bob")
    traffic = server.node.traffic
    writes, frames = traffic.socket_writes, traffic.frames_sent
    for n in range(1, 11):
        send_frame([a, b], event("chess", "g1", n), LIMIT)
        await asyncio.sleep(0)
    for client in (alice, bob):
        await client.next_message(lambda m: m.get("payload", {}).get("n") == 10)
        assert numbers(client) == list(range(1, 11))
    assert traffic.frames_sent - frames == 20
    # Each flush waited for at least four turns' frames, however slow the turns
    # (one flush more if one was under way at the start): without the delay, 20.
    assert traffic.socket_writes - writes <= 2 * 4


@pytest.mark.parametrize("server", [{"write_delay_ms": 20}], indirect=True)
async def test_with_a_write_delay_a_close_writes_the_held_frames_first(
    server: RunningServer,
) -> None:
    alice, session = await alice_held(server)
    await busy_turns(session, range(1, 4))
    assert session.pending is not None  # held
    session.close(CloseCode.POLICY_VIOLATION, "going")
    assert await alice.closed() == (CloseCode.POLICY_VIOLATION, "going")
    assert numbers(alice) == [1, 2, 3]


@pytest.mark.parametrize("server", [{"write_delay_ms": 20}], indirect=True)
async def test_within_a_write_delay_many_frames_or_a_big_one_do_not_wait(
    server: RunningServer,
) -> None:
    alice, session = await alice_held(server)
    traffic = server.node.traffic
    writes = traffic.socket_writes
    await busy_turns(session, range(1, HELD_FRAMES))
    assert traffic.socket_writes == writes  # fewer than HELD_FRAMES: they wait
    send_frame([session], event("chess", "g1", HELD_FRAMES), LIMIT)
    await alice.next_message(lambda m: m.get("payload", {}).get("n") == HELD_FRAMES)
    assert traffic.socket_writes == writes + 1
    await busy_turns(session, range(HELD_FRAMES + 1, HELD_FRAMES + 3))
    big = GameEvent("game", "chess", "g1", {"n": 0, "pad": "x" * HELD_FRAME_BYTES})
    send_frame([session], Frame(Positioned(big, game_stream(big.key), "e", 99)), LIMIT)
    await alice.next_message(lambda m: m.get("payload", {}).get("n") == 0)
    assert numbers(alice) == [*range(1, HELD_FRAMES + 3), 0]
    assert traffic.socket_writes == writes + 2
