"""The ``chat`` action: validation of untrusted comments, and the comment size rules.

Lengths are counted in UTF-16 code units, as JavaScript's ``length`` and
``substring`` count them, so the server cuts a comment exactly where the browser
and today's backend cut it (an emoji is two units).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

from protocol.errors import (
    MAX_CLIENT_MSG_ID_CHARS,
    MAX_COMMENT_UNITS,
    MAX_GAME_FIELD_CHARS,
    MAX_MOVE_NUMBER,
    STORED_COMMENT_UNITS,
    ErrorCode,
    ProtocolError,
)
from protocol.messages import Chat

COMMENT_OVERHEAD_BYTES = 110
"""What today's backend adds per comment when it sums an item's size."""

COMMENTS_CAP_BYTES = 360_000
"""Σ(110 + UTF-8 bytes) over a game's comments must stay under this (today's cap)."""


def utf16_units(text: str) -> int:
    """``text.length`` in JavaScript."""
    return len(text) + sum(1 for char in text if ord(char) > 0xFFFF)


def cut_utf16(text: str, units: int) -> str:
    """``text.substring(0, units)``, except that it never splits a surrogate pair."""
    if len(text) <= units // 2 or utf16_units(text) <= units:
        return text
    taken = 0
    for index, char in enumerate(text):
        taken += 2 if ord(char) > 0xFFFF else 1
        if taken > units:
            return text[:index]
    return text


def comment_weight(comment: str) -> int:
    """One comment's share of the cap: 110 + its UTF-8 bytes."""
    return COMMENT_OVERHEAD_BYTES + len(comment.encode("utf-8"))


def parse_chat(message: Mapping[str, Any]) -> Chat:
    """Validate a ``chat`` action; errors carry the ``clientMsgId`` when it is usable."""
    raw_id = message.get("clientMsgId")
    client_msg_id = raw_id if _is_text(raw_id, MAX_CLIENT_MSG_ID_CHARS) else None

    def fail(code: ErrorCode, text: str) -> ProtocolError:
        return ProtocolError(code, text, client_msg_id)

    if client_msg_id is None:
        raise fail(
            ErrorCode.INVALID_MESSAGE,
            f"chat needs a 'clientMsgId' string of 1 to {MAX_CLIENT_MSG_ID_CHARS} characters",
        )
    meta, game_id = message.get("meta"), message.get("id")
    if not _is_text(meta, MAX_GAME_FIELD_CHARS) or "#" in meta:
        raise fail(ErrorCode.INVALID_MESSAGE, "chat needs a string 'meta' (no '#')")
    if not _is_text(game_id, MAX_GAME_FIELD_CHARS):
        raise fail(ErrorCode.INVALID_MESSAGE, "chat needs a string 'id'")
    move_number = message.get("moveNumber")
    if (
        isinstance(move_number, bool)
        or not isinstance(move_number, int)
        or not 0 <= move_number <= MAX_MOVE_NUMBER
    ):
        raise fail(ErrorCode.INVALID_MESSAGE, "'moveNumber' must be a whole number, 0 or more")
    comment = message.get("comment")
    if not isinstance(comment, str):
        raise fail(ErrorCode.INVALID_MESSAGE, "chat needs a string 'comment'")
    if utf16_units(comment) > MAX_COMMENT_UNITS:
        raise fail(
            ErrorCode.COMMENT_TOO_LONG,
            f"a comment may have at most {MAX_COMMENT_UNITS} characters",
        )
    if not _encodable(comment):
        raise fail(ErrorCode.INVALID_MESSAGE, "comment is not valid unicode")
    if not comment.strip():
        raise fail(ErrorCode.COMMENT_EMPTY, "refusing to accept a blank comment")
    return Chat(
        meta=meta,
        game_id=game_id,
        comment=cut_utf16(comment, STORED_COMMENT_UNITS),
        move_number=move_number,
        client_msg_id=client_msg_id,
    )


def _is_text(value: Any, limit: int) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= limit and _encodable(value)


def _encodable(value: str) -> bool:
    # json.loads lets lone surrogates through; they cannot be stored or re-encoded.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
