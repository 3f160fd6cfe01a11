"""Sans-I/O pieces of streams: since parsing, user publishes, frames, positioned bus messages."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.codec import Frame
from protocol.envelope import (
    EnvelopeError,
    decode_envelope,
    decode_positioned,
    encode_envelope,
    encode_positioned,
    is_positioned,
)
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import (
    Broadcast,
    GameEvent,
    Position,
    Positioned,
    Recovered,
    Skip,
    Subscribe,
    UserEvent,
    WatchGames,
)
from protocol.parse import parse_broadcast, parse_client_message
from protocol.streams import game_stream, stream_game, stream_user, user_stream


def test_stream_names() -> None:
    assert game_stream("chess#g1") == "game:chess#g1"
    assert user_stream("bot1") == "user:bot1"
    assert stream_game("game:chess#g1") == "chess#g1" and stream_game("user:x") is None
    assert stream_user("user:bot1") == "bot1" and stream_user("game:a#b") is None


def test_since_is_parsed_on_subscribe_and_watch_games() -> None:
    since = {"game:chess#g1": {"epoch": "e", "offset": 4}, "user:u": {"epoch": "", "offset": 0}}
    sub = parse_client_message({"action": "subscribe", "token": "t", "since": since})
    assert isinstance(sub, Subscribe)
    assert sub.since == {"game:chess#g1": Position("e", 4), "user:u": Position("", 0)}
    watch = parse_client_message({"action": "watchGames", "games": [], "since": {}})
    assert isinstance(watch, WatchGames) and watch.since == {}
    plain = parse_client_message({"action": "watchGames", "games": []})
    assert isinstance(plain, WatchGames) and plain.since is None


@pytest.mark.parametrize(
    "since",
    [
        {"s": {"epoch": 1, "offset": 0}},
        {"s": {"epoch": "e", "offset": -1}},
        {"s": {"epoch": "e", "offset": 2.0}},
        {"s": {"epoch": "e", "offset": False}},
        {"s": {"offset": 1}},
        {"": {"epoch": "e", "offset": 1}},
        {"s": None},
        "s",
        {f"s{i}": {"epoch": "e", "offset": 0} for i in range(1001)},
    ],
)
def test_a_malformed_since_is_refused(since: Any) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_client_message({"action": "watchGames", "games": [], "since": since})
    assert caught.value.code is ErrorCode.INVALID_MESSAGE


def test_a_user_publish_is_parsed_with_unique_users() -> None:
    body = {"verb": "yourTurn", "payload": {"id": "g"}, "users": ["a", "b", "a"], "exclude": ["b"]}
    message = parse_broadcast(json.dumps(body))
    assert message.event == UserEvent("yourTurn", ("a", "b"), {"id": "g"})
    assert message.exclude == frozenset({"b"})


@pytest.mark.parametrize(
    "body",
    [
        {"verb": "game", "payload": {"meta": "m", "id": "g"}, "users": ["a"]},
        {"verb": "test", "payload": 1, "users": ["a"]},
        {"verb": 3, "payload": 1, "users": ["a"]},
        {"verb": "yourTurn", "payload": 1, "users": []},
        {"verb": "yourTurn", "payload": 1, "users": [""]},
        {"verb": "yourTurn", "payload": 1, "users": {"a": 1}},
        {"verb": "yourTurn", "payload": 1, "users": [f"u{i}" for i in range(1001)]},
    ],
)
def test_a_bad_user_publish_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        parse_broadcast(json.dumps(body))


def test_stream_frames_on_the_wire() -> None:
    event = GameEvent("game", "chess", "g1", {"meta": "chess", "id": "g1"})
    frame = Frame(Positioned(event, "game:chess#g1", "e", 3))
    wire = {
        "verb": "game",
        "payload": {"meta": "chess", "id": "g1"},
        "stream": "game:chess#g1",
        "epoch": "e",
        "offset": 3,
    }
    assert json.loads(frame.text) == wire
    assert msgpack.unpackb(frame.binary) == wire
    assert json.loads(Frame(Skip("user:u", "e", 2)).text) == {
        "verb": "skip",
        "stream": "user:u",
        "epoch": "e",
        "offset": 2,
    }
    assert json.loads(Frame(Recovered("user:u", False, "e", 9)).text) == {
        "verb": "recovered",
        "payload": {"stream": "user:u", "recovered": False, "epoch": "e", "offset": 9},
    }


def test_a_user_event_envelope_round_trips_without_its_recipients() -> None:
    message = Broadcast(UserEvent("notification", ("a", "b"), {"x": 1}), frozenset({"c"}))
    decoded = decode_envelope(encode_envelope(message))
    assert isinstance(decoded, Broadcast)
    # The recipient is the user of the stream it travels on.
    assert decoded.event == UserEvent("notification", (), {"x": 1})
    assert decoded.exclude == frozenset({"c"})


@given(
    st.text(alphabet="0123456789abcdef", min_size=1, max_size=16),
    st.integers(1, 2**53),
    st.binary(max_size=64),
)
def test_positioned_messages_round_trip(epoch: str, offset: int, data: bytes) -> None:
    raw = encode_positioned(epoch, offset, data)
    assert is_positioned(raw)
    decoded = decode_positioned(raw)
    assert (decoded.epoch, decoded.offset, decoded.data) == (epoch, offset, data)


def test_a_bare_envelope_is_never_taken_for_a_positioned_one() -> None:
    message = Broadcast(GameEvent("game", "m", "g", {"meta": "m", "id": "g"}))
    assert not is_positioned(encode_envelope(message))
    with pytest.raises(EnvelopeError):
        decode_positioned(b"\x00e\x00notanumber\x00data")
