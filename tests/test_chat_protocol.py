"""protocol/chat.py: the chat action, its limits and the UTF-16 rules, with hypothesis."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.chat import comment_weight, cut_utf16, parse_chat, utf16_units
from protocol.codec import Frame
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import Chat, ChatAck, ErrorMessage
from protocol.parse import parse_client_frame, parse_client_message

GOOD: dict[str, Any] = {
    "action": "chat",
    "meta": "chess",
    "id": "g1",
    "comment": "gg",
    "moveNumber": 12,
    "clientMsgId": "0b7c-1",
}


def test_a_chat_as_the_client_sends_it() -> None:
    assert parse_client_frame(json.dumps(GOOD)) == Chat("chess", "g1", "gg", 12, "0b7c-1")
    assert parse_client_frame(msgpack.packb(GOOD)) == Chat("chess", "g1", "gg", 12, "0b7c-1")


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"moveNumber": 1.5}, ErrorCode.INVALID_MESSAGE),
        ({"moveNumber": "1"}, ErrorCode.INVALID_MESSAGE),
        ({"moveNumber": False}, ErrorCode.INVALID_MESSAGE),
        ({"moveNumber": 10**12}, ErrorCode.INVALID_MESSAGE),
        ({"meta": "a#b"}, ErrorCode.INVALID_MESSAGE),
        ({"meta": ""}, ErrorCode.INVALID_MESSAGE),
        ({"id": 7}, ErrorCode.INVALID_MESSAGE),
        ({"comment": None}, ErrorCode.INVALID_MESSAGE),
        ({"comment": " \u3000\n"}, ErrorCode.COMMENT_EMPTY),
        ({"comment": "x" * 16_001}, ErrorCode.COMMENT_TOO_LONG),
        ({"comment": "🎉" * 8_001}, ErrorCode.COMMENT_TOO_LONG),  # 16,002 UTF-16 units
        ({"comment": "ok \udc00"}, ErrorCode.INVALID_MESSAGE),
    ],
)
def test_bad_chats_carry_their_client_msg_id(change: dict[str, Any], code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as raised:
        parse_client_message({**GOOD, **change})
    assert raised.value.code is code and raised.value.client_msg_id == "0b7c-1"


@pytest.mark.parametrize("bad_id", [None, "", 5, "x" * 129, "\ud800"])
def test_a_chat_without_a_usable_client_msg_id_is_refused(bad_id: Any) -> None:
    with pytest.raises(ProtocolError) as raised:
        parse_client_message({**GOOD, "clientMsgId": bad_id})
    assert raised.value.code is ErrorCode.INVALID_MESSAGE
    assert raised.value.client_msg_id is None


def test_16000_units_are_accepted_and_cut_to_4000() -> None:
    chat = parse_chat({**GOOD, "comment": "x" * 16_000})
    assert chat.comment == "x" * 4000
    emoji = parse_chat({**GOOD, "comment": "a" + "🎉" * 3000})
    assert utf16_units(emoji.comment) == 3999 and emoji.comment.endswith("🎉")


@given(st.text(max_size=6000))
@settings(max_examples=200, deadline=None)
def test_the_cut_is_javascripts_substring_without_split_pairs(text: str) -> None:
    cut = cut_utf16(text, 4000)
    assert text.startswith(cut)
    assert utf16_units(cut) <= 4000
    units = text.encode("utf-16-le")
    expected = units[:8000].decode("utf-16-le", errors="ignore")
    # JavaScript would keep a lone high surrogate at the end; we drop that half.
    assert cut == expected


@given(
    st.fixed_dictionaries(
        {"action": st.just("chat")},
        optional={
            "meta": st.one_of(st.text(max_size=200), st.integers(), st.none()),
            "id": st.one_of(st.text(max_size=200), st.integers()),
            "comment": st.one_of(st.text(max_size=300), st.binary(max_size=20), st.none()),
            "moveNumber": st.one_of(st.integers(), st.floats(), st.booleans(), st.text()),
            "clientMsgId": st.one_of(st.text(max_size=200), st.integers()),
        },
    )
)
@settings(max_examples=300, deadline=None)
def test_any_chat_shape_gives_a_chat_or_a_clean_error(message: dict[str, Any]) -> None:
    try:
        chat = parse_client_message(message)
    except ProtocolError as error:
        assert error.message
        return
    assert isinstance(chat, Chat) and chat.comment.strip()


def test_weight_is_110_plus_utf8_bytes() -> None:
    assert comment_weight("a") == 111 and comment_weight("é") == 112 and comment_weight("🎉") == 114


def test_ack_and_error_frames() -> None:
    assert json.loads(Frame(ChatAck("m1", 1700)).text) == {
        "verb": "chatAck",
        "payload": {"clientMsgId": "m1", "timeStamp": 1700},
    }
    assert msgpack.unpackb(Frame(ErrorMessage("comments_full", "full", "m1")).binary) == {
        "verb": "error",
        "payload": {"code": "comments_full", "message": "full", "clientMsgId": "m1"},
    }
    assert json.loads(Frame(ErrorMessage("x", "y")).text)["payload"] == {
        "code": "x",
        "message": "y",
    }
