"""protocol/client.py: the client's actions, and server frames read back exactly as the
server built them (the inverse of protocol.codec.to_wire), with plain values."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.client import (
    UnknownFrame,
    encode_action,
    parse_server_frame,
    parse_server_message,
    subscribe_action,
    sync_presence_action,
    watch_games_action,
)
from protocol.codec import Frame, to_wire
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import (
    Ack,
    AdminTest,
    ChatAck,
    ErrorMessage,
    GameEvent,
    Heartbeat,
    PendingTurns,
    Ply,
    Position,
    Positioned,
    PresenceDelta,
    PresenceSnapshot,
    Recovered,
    ServerMessage,
    Skip,
    Subscribe,
    UserEvent,
    WatchGames,
)
from protocol.parse import parse_client_frame

text = st.text(min_size=1, max_size=12)
count = st.integers(min_value=0, max_value=2**53)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def game_payloads() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"meta": text.filter(lambda m: "#" not in m), "id": text},
        optional={"n": st.integers(0, 100), "comment": st.text(max_size=8)},
    )


def game_events() -> st.SearchStrategy[GameEvent]:
    return st.builds(
        lambda verb, payload: GameEvent(verb, payload["meta"], payload["id"], payload),
        st.sampled_from(["game", "chat"]),
        game_payloads(),
    )


plies = st.none() | st.builds(
    Ply, st.none() | count, st.none() | st.integers(0, 2**53) | st.floats(0, 1e13)
).filter(lambda p: p.moves is not None or p.time is not None)


def pending_turns(entries: list[tuple[tuple[str, str], Ply | None]]) -> PendingTurns:
    """The canonical form: plies only when some game names one."""
    plies = tuple(ply for _, ply in entries)
    games = tuple(ref for ref, _ in entries)
    return PendingTurns(games, plies if any(p is not None for p in plies) else ())


server_messages: st.SearchStrategy[ServerMessage] = st.one_of(
    st.builds(PresenceSnapshot, count, count, st.lists(text, max_size=4).map(tuple)),
    st.builds(
        PresenceDelta,
        count,
        st.lists(text, max_size=3).map(tuple),
        st.lists(text, max_size=3).map(tuple),
        count,
    ),
    st.builds(Positioned, game_events(), text, text, count),
    st.builds(
        Positioned,
        st.builds(
            UserEvent, st.sampled_from(["yourTurn", "notification"]), st.just(()), json_values
        ),
        text,
        text,
        count,
    ),
    st.builds(Skip, text, text, count),
    st.builds(Recovered, text, st.booleans(), text, count),
    st.lists(st.tuples(st.tuples(text, text), plies), max_size=3).map(pending_turns),
    st.builds(ChatAck, text, count),
    st.builds(ErrorMessage, text, text, st.none() | text, st.none() | text),
    st.builds(AdminTest, json_values),
    st.builds(
        Ack,
        text,
        st.sampled_from(["subscribe", "watchGames"]),
        st.none() | st.integers(1, 300),
    ),
    st.just(Heartbeat()),
)


@given(server_messages)
def test_every_server_frame_reads_back_as_the_message_it_was_built_from(
    message: ServerMessage,
) -> None:
    frame = Frame(message)
    for data in (frame.text, frame.binary):
        parsed = parse_server_frame(data)
        assert parsed == message
        assert to_wire(parsed) == to_wire(message)  # payloads too (compared by value here)


def test_an_unpositioned_game_event_is_read_as_one() -> None:
    parsed = parse_server_message({"verb": "game", "payload": {"meta": "chess", "id": "g"}})
    assert parsed == GameEvent("game", "chess", "g", {})


def test_a_verb_from_a_newer_server_is_passed_on_not_refused() -> None:
    parsed = parse_server_message({"verb": "shiny", "payload": {"x": 1}})
    assert isinstance(parsed, UnknownFrame) and parsed.verb == "shiny"
    assert parsed.payload == {"x": 1}
    positioned = parse_server_message(
        {"verb": "gameStart", "payload": [1], "stream": "user:u", "epoch": "e", "offset": 3}
    )
    assert positioned == Positioned(UserEvent("gameStart", (), [1]), "user:u", "e", 3)


def test_a_delta_without_total_count_is_marked_unknown() -> None:
    parsed = parse_server_message(
        {"verb": "connections", "payload": {"type": "delta", "seq": 2, "joins": [], "leaves": []}}
    )
    assert isinstance(parsed, PresenceDelta) and parsed.total_count == -1


@pytest.mark.parametrize(
    "message",
    [
        [],
        {"payload": {}},
        {"verb": 3},
        {"verb": "game", "stream": "s", "epoch": "e", "offset": -1},
        {"verb": "skip", "stream": "s", "epoch": 1, "offset": 1},
        {"verb": "skip", "stream": "s", "epoch": "e", "offset": True},
        {
            "verb": "recovered",
            "payload": {"stream": "s", "recovered": 1, "epoch": "e", "offset": 0},
        },
        {"verb": "connections", "payload": {"type": "other"}},
        {"verb": "connections", "payload": {"type": "snapshot", "seq": "1"}},
        {"verb": "ack", "payload": {"ackId": "a", "action": "chat"}},
        {"verb": "error", "payload": {"code": "x"}},
        {"verb": "pendingTurns", "payload": {"games": {}}},
        {"verb": "chatAck", "payload": None},
    ],
)
def test_a_malformed_server_frame_is_an_invalid_frame(message: Any) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_server_message(message)
    assert caught.value.code is ErrorCode.INVALID_FRAME


@given(st.binary(max_size=64))
def test_any_bytes_read_as_a_frame_or_a_clean_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        parse_server_frame(data)


def test_the_actions_are_what_the_server_parses() -> None:
    since = {"game:chess#g1": Position("e", 4), "user:u": Position("", 0)}
    action = subscribe_action(
        "tok",
        games=[("chess", "g1")],
        since=since,
        ack_id="s1",
        heartbeat=True,
        invisible=True,
        wants_presence=False,
    )
    for binary in (False, True):
        parsed = parse_client_frame(encode_action(action, binary=binary))
        assert parsed == Subscribe(
            token="tok",
            invisible=True,
            wants_presence=False,
            watch_version=1,
            games=frozenset({"chess#g1"}),
            since=since,
            ack_id="s1",
            heartbeat=True,
        )
    watch = parse_client_frame(
        encode_action(watch_games_action([("go", "x")], since={}, ack_id="w1"))
    )
    assert watch == WatchGames(games=frozenset({"go#x"}), since={}, ack_id="w1")
    assert json.loads(encode_action(sync_presence_action())) == {"action": "syncPresence"}
    # Defaults are left out: a plain subscribe is what the live browser sends.
    assert subscribe_action("t") == {"action": "subscribe", "token": "t", "watchVersion": 1}
    assert msgpack.unpackb(encode_action({"action": "x"}, binary=True)) == {"action": "x"}
