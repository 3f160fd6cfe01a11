"""protocol/: parsing, validation and codecs, with plain values and hypothesis."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import codec
from protocol.codec import Frame
from protocol.envelope import EnvelopeError, PresenceHint, decode_envelope, encode_envelope
from protocol.errors import MAX_WATCHED_GAMES, ErrorCode, ProtocolError
from protocol.messages import (
    Ack,
    AdminTest,
    Broadcast,
    ErrorMessage,
    GameEvent,
    Heartbeat,
    PresenceDelta,
    PresenceSnapshot,
    Subscribe,
    SyncPresence,
    WatchGames,
)
from protocol.parse import parse_broadcast, parse_client_frame, parse_client_message

ACTIONS = (Subscribe, WatchGames, SyncPresence)


def error_of(data: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        if isinstance(data, str | bytes):
            parse_client_frame(data)
        else:
            parse_client_message(data)
    return caught.value


# --- client actions ---------------------------------------------------------


def test_subscribe_as_the_browser_sends_it() -> None:
    action = parse_client_frame(
        json.dumps(
            {
                "action": "subscribe",
                "token": "t",
                "invisible": True,
                "watchVersion": 1,
                "games": [{"meta": "chess", "id": "g1"}, {"meta": "go", "id": "g2"}],
            }
        )
    )
    assert action == Subscribe(
        token="t",
        invisible=True,
        wants_presence=None,
        watch_version=1,
        games=frozenset({"chess#g1", "go#g2"}),
    )


def test_subscribe_defaults_for_a_legacy_client() -> None:
    action = parse_client_frame('{"action":"subscribe","token":"t"}')
    assert action == Subscribe(token="t")
    assert isinstance(action, Subscribe)
    assert action.games is None and action.watch_version is None
    # Not given: the node decides (humans get presence, bots do not).
    assert action.wants_presence is None


def test_unknown_extra_fields_are_ignored() -> None:
    action = parse_client_frame('{"action":"syncPresence","extra":{"a":[1,2]},"x":1}')
    assert action == SyncPresence()


def test_game_refs_missing_a_field_are_ignored() -> None:
    action = parse_client_message(
        {
            "action": "watchGames",
            "games": [
                {"meta": "chess"},
                {"id": "g1"},
                {"meta": "", "id": "g"},
                {"meta": 5, "id": "g"},
                "chess#g1",
                {"meta": "chess", "id": "g1", "extra": True},
            ],
        }
    )
    assert action == WatchGames(games=frozenset({"chess#g1"}))


def test_watch_games_needs_a_list() -> None:
    assert error_of({"action": "watchGames"}).code is ErrorCode.INVALID_MESSAGE
    assert error_of({"action": "watchGames", "games": {}}).code is ErrorCode.INVALID_MESSAGE


def test_watch_list_is_capped() -> None:
    games = [{"meta": "m", "id": str(i)} for i in range(MAX_WATCHED_GAMES + 1)]
    error = error_of({"action": "watchGames", "games": games})
    assert error.code is ErrorCode.TOO_MANY_GAMES
    assert str(MAX_WATCHED_GAMES) in error.message
    at_cap = parse_client_message({"action": "watchGames", "games": games[:-1]})
    assert isinstance(at_cap, WatchGames) and len(at_cap.games) == MAX_WATCHED_GAMES


def test_overlong_game_fields_are_ignored() -> None:
    action = parse_client_message(
        {
            "action": "watchGames",
            "games": [{"meta": "m" * 129, "id": "1"}, {"meta": "m", "id": "2"}],
        }
    )
    assert action == WatchGames(games=frozenset({"m#2"}))


def test_lone_surrogates_are_not_game_refs() -> None:
    action = parse_client_frame('{"action":"watchGames","games":[{"meta":"\\ud800","id":"1"}]}')
    assert action == WatchGames(games=frozenset())


@pytest.mark.parametrize(
    ("data", "code"),
    [
        ("not json", ErrorCode.INVALID_FRAME),
        ("[" * 5000, ErrorCode.INVALID_FRAME),
        (b"\xc1", ErrorCode.INVALID_FRAME),
        ("[]", ErrorCode.INVALID_MESSAGE),
        ('"subscribe"', ErrorCode.INVALID_MESSAGE),
        ("{}", ErrorCode.INVALID_MESSAGE),
        ('{"action":7}', ErrorCode.INVALID_MESSAGE),
        ('{"action":"dance"}', ErrorCode.UNKNOWN_ACTION),
        ('{"action":"subscribe"}', ErrorCode.UNAUTHORIZED),
        ('{"action":"subscribe","token":""}', ErrorCode.UNAUTHORIZED),
        ('{"action":"subscribe","token":"t","invisible":"yes"}', ErrorCode.INVALID_MESSAGE),
        ('{"action":"subscribe","token":"t","watchVersion":"1"}', ErrorCode.INVALID_MESSAGE),
        ('{"action":"subscribe","token":"t","watchVersion":true}', ErrorCode.INVALID_MESSAGE),
        ('{"action":"subscribe","token":"t","watchVersion":1e400}', ErrorCode.INVALID_MESSAGE),
        ('{"action":"subscribe","token":"t","watchVersion":9999999}', ErrorCode.INVALID_MESSAGE),
        ('{"action":"subscribe","token":"t","wantsPresence":0}', ErrorCode.INVALID_MESSAGE),
    ],
)
def test_bad_frames_get_a_clear_error(data: str | bytes, code: ErrorCode) -> None:
    error = error_of(data)
    assert error.code is code
    assert error.message


def test_unknown_action_names_it() -> None:
    assert '"dance"' in error_of('{"action":"dance"}').message


def test_msgpack_frames_parse_like_json() -> None:
    data = msgpack.packb({"action": "watchGames", "games": [{"meta": "a", "id": "b"}]})
    assert parse_client_frame(data) == WatchGames(games=frozenset({"a#b"}))


@settings(max_examples=500)
@given(st.binary(max_size=512))
def test_any_bytes_give_an_action_or_a_clean_error(data: bytes) -> None:
    try:
        assert isinstance(parse_client_frame(data), ACTIONS)
    except ProtocolError as error:
        assert isinstance(error.code, ErrorCode) and error.message


@settings(max_examples=500)
@given(st.text(max_size=512))
def test_any_text_gives_an_action_or_a_clean_error(data: str) -> None:
    try:
        assert isinstance(parse_client_frame(data), ACTIONS)
    except ProtocolError as error:
        assert isinstance(error.code, ErrorCode) and error.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)
action_like = st.fixed_dictionaries(
    {"action": st.sampled_from(["subscribe", "watchGames", "syncPresence", "other"])},
    optional={
        "token": json_values,
        "invisible": json_values,
        "watchVersion": json_values,
        "wantsPresence": json_values,
        "games": st.lists(
            st.fixed_dictionaries({}, optional={"meta": json_values, "id": json_values}),
            max_size=5,
        )
        | json_values,
    },
)


@settings(max_examples=300)
@given(st.one_of(json_values, action_like))
def test_any_decoded_value_gives_an_action_or_a_clean_error(value: Any) -> None:
    frames: list[str | bytes] = [json.dumps(value)]
    with contextlib.suppress(OverflowError):  # msgpack has no integers over 64 bits
        frames.append(msgpack.packb(value))
    for frame in frames:
        try:
            action = parse_client_frame(frame)
        except ProtocolError as error:
            assert isinstance(error.code, ErrorCode)
            continue
        assert isinstance(action, ACTIONS)
        if isinstance(action, Subscribe):
            assert isinstance(action.token, str) and action.token
        if isinstance(action, WatchGames | Subscribe) and action.games is not None:
            assert all(isinstance(key, str) and "#" in key for key in action.games)


# --- backend broadcasts -----------------------------------------------------


def test_broadcast_of_a_move() -> None:
    message = parse_broadcast(
        b'{"verb":"game","payload":{"meta":"chess","id":"g1","extra":1},"exclude":["u1"]}'
    )
    assert isinstance(message.event, GameEvent)
    assert message.event.key == "chess#g1"
    assert message.event.payload == {"meta": "chess", "id": "g1", "extra": 1}
    assert message.exclude == frozenset({"u1"})


def test_broadcast_of_chat_and_test() -> None:
    chat = parse_broadcast('{"verb":"chat","payload":{"meta":"go","id":"7"}}')
    assert isinstance(chat.event, GameEvent) and chat.event.verb == "chat"
    test = parse_broadcast('{"verb":"test","payload":"hello"}')
    assert test == Broadcast(event=AdminTest(payload="hello"))


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{", "JSON"),
        (b"[]", "object"),
        (b'{"verb":"dance","payload":{}}', '"dance"'),
        (b'{"payload":{}}', "verb"),
        (b'{"verb":"game","payload":{"meta":"m"}}', "'meta' and 'id'"),
        (b'{"verb":"game","payload":{"id":"1"}}', "'meta' and 'id'"),
        (b'{"verb":"game","payload":[]}', "object"),
        (b'{"verb":"game","payload":{"meta":"m","id":"1"},"exclude":"u"}', "exclude"),
        (b'{"verb":"test","payload":18446744073709551616}', "encoded"),
    ],
)
def test_bad_broadcasts_are_refused_with_a_reason(body: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_broadcast(body)
    assert fragment in caught.value.message


# --- codec ------------------------------------------------------------------


def test_frames_match_the_live_wire_format() -> None:
    snapshot = Frame(PresenceSnapshot(seq=4, total_count=3, visible_user_ids=("a", "b")))
    assert json.loads(snapshot.text) == {
        "verb": "connections",
        "payload": {"type": "snapshot", "seq": 4, "totalCount": 3, "visibleUserIds": ["a", "b"]},
    }
    delta = Frame(PresenceDelta(seq=5, joins=("c",), leaves=("a",), total_count=3))
    assert json.loads(delta.text) == {
        "verb": "connections",
        "payload": {"type": "delta", "seq": 5, "joins": ["c"], "leaves": ["a"], "totalCount": 3},
    }
    assert msgpack.unpackb(delta.binary) == json.loads(delta.text)


def test_a_frame_is_encoded_once_per_format(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = codec.to_wire

    def counting(message: Any) -> Any:
        calls.append(message)
        return original(message)

    monkeypatch.setattr(codec, "to_wire", counting)
    frame = Frame(AdminTest(payload={"x": 1}))
    first = frame.text_wire
    for _ in range(100):
        assert frame.text_wire is first
        assert frame.binary_wire is frame.binary_wire
    assert len(calls) == 1


@pytest.mark.parametrize("size", [10, 200, 70_000])
def test_wire_frames_are_what_a_websocket_reader_parses(size: int) -> None:
    from websockets.frames import Frame as WireFrame
    from websockets.frames import Opcode
    from websockets.streams import StreamReader

    frame = Frame(AdminTest(payload="x" * size))
    for data, opcode, payload in (
        (frame.text_wire, Opcode.TEXT, frame.text.encode()),
        (frame.binary_wire, Opcode.BINARY, frame.binary),
    ):
        reader = StreamReader()
        reader.feed_data(data)
        parser = WireFrame.parse(reader.read_exact, mask=False)
        try:
            next(parser)
        except StopIteration as done:
            parsed = done.value
        assert (parsed.opcode, parsed.data, parsed.fin) == (opcode, payload, True)


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536, 70_000])
def test_frame_bytes_are_what_websockets_serializes(size: int) -> None:
    """``frame_bytes`` writes the header itself: it must stay byte for byte what
    the library writes for the same unmasked final frame (at every length form)."""
    from websockets.frames import Frame as WireFrame
    from websockets.frames import Opcode

    from protocol.codec import frame_bytes

    payload = b"x" * size
    for opcode in (Opcode.TEXT, Opcode.BINARY):
        ours = frame_bytes(0x80 | opcode.value, payload)
        assert ours == WireFrame(opcode, payload).serialize(mask=False)


# --- envelopes --------------------------------------------------------------


@pytest.mark.parametrize(
    "envelope",
    [
        Broadcast(
            event=GameEvent(verb="chat", meta="m", game_id="1", payload={"meta": "m", "id": "1"}),
            exclude=frozenset({"a", "b"}),
        ),
        Broadcast(event=AdminTest(payload=[1, "x"])),
        PresenceDelta(seq=9, joins=("a",), leaves=(), total_count=4),
        PresenceHint(node_id="n1", user_ids=("a", "b")),
        PresenceHint(node_id="n1", user_ids=("a",), changed_at=1_700_000_000.25),
    ],
)
def test_envelopes_round_trip(envelope: Any) -> None:
    decoded = decode_envelope(encode_envelope(envelope))
    assert decoded == envelope
    if isinstance(envelope, Broadcast):
        assert decoded.event.payload == envelope.event.payload  # type: ignore[union-attr]


def test_envelopes_carry_a_version_and_refuse_others() -> None:
    body = msgpack.unpackb(encode_envelope(PresenceHint(node_id="n", user_ids=())))
    assert body["v"] == 1
    body["v"] = 2
    with pytest.raises(EnvelopeError, match="version"):
        decode_envelope(msgpack.packb(body))
    with pytest.raises(EnvelopeError):
        decode_envelope(b"\x00garbage")


# --- acknowledgements and heartbeats -------------------------------------------


def test_ack_id_and_heartbeat_are_parsed() -> None:
    sub = parse_client_message(
        {"action": "subscribe", "token": "t", "ackId": "a" * 64, "heartbeat": True}
    )
    assert isinstance(sub, Subscribe) and sub.ack_id == "a" * 64 and sub.heartbeat
    plain = parse_client_message({"action": "subscribe", "token": "t"})
    assert isinstance(plain, Subscribe) and plain.ack_id is None and not plain.heartbeat
    watch = parse_client_message({"action": "watchGames", "games": [], "ackId": "w"})
    assert isinstance(watch, WatchGames) and watch.ack_id == "w"


@pytest.mark.parametrize("ack_id", ["", "a" * 65, 3, True, {}, "\ud800"])
def test_an_unusable_ack_id_fails_the_action_without_echo(ack_id: Any) -> None:
    for action in ({"action": "subscribe", "token": "t"}, {"action": "watchGames", "games": []}):
        with pytest.raises(ProtocolError) as caught:
            parse_client_message({**action, "ackId": ack_id})
        assert caught.value.code is ErrorCode.INVALID_MESSAGE
        assert caught.value.ack_id is None


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"action": "subscribe"}, ErrorCode.UNAUTHORIZED),
        ({"action": "subscribe", "token": "t", "heartbeat": 1}, ErrorCode.INVALID_MESSAGE),
        ({"action": "watchGames"}, ErrorCode.INVALID_MESSAGE),
        (
            {"action": "watchGames", "games": [{"meta": "m", "id": str(i)} for i in range(1001)]},
            ErrorCode.TOO_MANY_GAMES,
        ),
    ],
)
def test_errors_of_an_acked_action_carry_its_ack_id(
    message: dict[str, Any], code: ErrorCode
) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_client_message({**message, "ackId": "k1"})
    assert caught.value.code is code and caught.value.ack_id == "k1"


def test_ack_heartbeat_and_error_frames() -> None:
    assert json.loads(Frame(Ack("k", "watchGames")).text) == {
        "verb": "ack",
        "payload": {"ackId": "k", "action": "watchGames"},
    }
    assert json.loads(Frame(Ack("k", "subscribe", 15)).text) == {
        "verb": "ack",
        "payload": {"ackId": "k", "action": "subscribe", "heartbeatSeconds": 15},
    }
    assert json.loads(Frame(Heartbeat()).text) == {"verb": "heartbeat", "payload": {}}
    error = Frame(ErrorMessage("too_many_games", "no", ack_id="k"))
    assert msgpack.unpackb(error.binary) == {
        "verb": "error",
        "payload": {"code": "too_many_games", "message": "no", "ackId": "k"},
    }
