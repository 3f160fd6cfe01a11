"""Encode server messages into frames, once per event and format.

A :class:`Frame` is built once per event and handed to every recipient. Its
JSON text (browsers) and msgpack bytes (``ap.msgpack`` clients), and the
WebSocket frames that carry them, are each produced at most once, on first use.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
from websockets.frames import Opcode

from protocol.messages import (
    Ack,
    AdminTest,
    ChatAck,
    GameEvent,
    Heartbeat,
    PendingTurns,
    Positioned,
    PresenceDelta,
    PresenceSnapshot,
    Recovered,
    ServerMessage,
    Skip,
    UserEvent,
    ply_fields,
)


def to_wire(message: ServerMessage) -> dict[str, Any]:
    """The ``{"verb", "payload"}`` object of a server message."""
    if isinstance(message, PresenceDelta):
        return {
            "verb": "connections",
            "payload": {
                "type": "delta",
                "seq": message.seq,
                "joins": list(message.joins),
                "leaves": list(message.leaves),
                "totalCount": message.total_count,
            },
        }
    if isinstance(message, PresenceSnapshot):
        return {
            "verb": "connections",
            "payload": {
                "type": "snapshot",
                "seq": message.seq,
                "totalCount": message.total_count,
                "visibleUserIds": list(message.visible_user_ids),
            },
        }
    if isinstance(message, Positioned):
        # Additive: old clients read verb and payload and ignore the rest.
        return {
            "verb": message.event.verb,
            "payload": message.event.payload,
            "stream": message.stream,
            "epoch": message.epoch,
            "offset": message.offset,
        }
    if isinstance(message, GameEvent | UserEvent):
        return {"verb": message.verb, "payload": message.payload}
    if isinstance(message, Skip):
        return {
            "verb": "skip",
            "stream": message.stream,
            "epoch": message.epoch,
            "offset": message.offset,
        }
    if isinstance(message, Recovered):
        return {
            "verb": "recovered",
            "payload": {
                "stream": message.stream,
                "recovered": message.recovered,
                "epoch": message.epoch,
                "offset": message.offset,
            },
        }
    if isinstance(message, AdminTest):
        return {"verb": "test", "payload": message.payload}
    if isinstance(message, PendingTurns):
        games: list[dict[str, Any]] = [
            {"meta": meta, "id": game_id} for meta, game_id in message.games
        ]
        for entry, ply in zip(games, message.plies, strict=False):
            if ply is not None:
                entry.update(ply_fields(ply))
        return {"verb": "pendingTurns", "payload": {"games": games}}
    if isinstance(message, ChatAck):
        return {
            "verb": "chatAck",
            "payload": {"clientMsgId": message.client_msg_id, "timeStamp": message.time_stamp},
        }
    if isinstance(message, Ack):
        ack: dict[str, Any] = {"ackId": message.ack_id, "action": message.action}
        if message.heartbeat_seconds is not None:
            ack["heartbeatSeconds"] = message.heartbeat_seconds
        return {"verb": "ack", "payload": ack}
    if isinstance(message, Heartbeat):
        return {"verb": "heartbeat", "payload": {}}
    payload: dict[str, Any] = {"code": message.code, "message": message.message}
    if message.client_msg_id is not None:
        payload["clientMsgId"] = message.client_msg_id
    if message.ack_id is not None:
        payload["ackId"] = message.ack_id
    return {"verb": "error", "payload": payload}


class Frame:
    """One server message, encoded lazily and at most once per format.

    Plain slots filled on first use rather than ``functools.cached_property``:
    it is built for every event, and the descriptor's lookups cost more than
    the encoding of a small message.
    """

    __slots__ = ("_binary", "_binary_wire", "_text", "_text_wire", "_wire", "message")

    count = 1
    """Frames it stands for on the wire (a :class:`FrameRun` stands for several)."""

    def __init__(self, message: ServerMessage) -> None:
        self.message = message
        self._wire: dict[str, Any] | None = None
        self._text: str | None = None
        self._binary: bytes | None = None
        self._text_wire: bytes | None = None
        self._binary_wire: bytes | None = None

    @property
    def wire(self) -> dict[str, Any]:
        wire = self._wire
        if wire is None:
            wire = self._wire = to_wire(self.message)
        return wire

    @property
    def text(self) -> str:
        """The JSON text frame."""
        text = self._text
        if text is None:
            text = self._text = compact_json(self.wire)
        return text

    @property
    def text_utf8(self) -> bytes:
        """The JSON text frame's UTF-8 bytes, ready for the socket."""
        return self.text.encode()

    @property
    def binary(self) -> bytes:
        """The msgpack binary frame."""
        data = self._binary
        if data is None:
            data = self._binary = msgpack.packb(self.wire, use_bin_type=True)
        return data

    # A server frame is never masked, so without extensions its bytes on the wire
    # are the same for every socket: frame it once, write it to each.

    @property
    def text_wire(self) -> bytes:
        """The complete WebSocket text frame (header and payload), unmasked."""
        data = self._text_wire
        if data is None:
            data = self._text_wire = frame_bytes(_TEXT, self.text.encode())
        return data

    @property
    def binary_wire(self) -> bytes:
        """The complete WebSocket binary frame (header and payload), unmasked."""
        data = self._binary_wire
        if data is None:
            data = self._binary_wire = frame_bytes(_BINARY, self.binary)
        return data


class FrameRun:
    """Frames sent back to back, their wire bytes joined once per format.

    A reconnect storm sends the same replay (the events after one position,
    then ``recovered``) to every client that missed the same events: joined
    once, each client's copy is one buffer, not a list of frames to walk.
    """

    __slots__ = ("_binary_wire", "_text_wire", "count", "frames")

    def __init__(self, frames: Sequence[Frame]) -> None:
        self.frames = tuple(frames)
        self.count = len(self.frames)
        self._text_wire: bytes | None = None
        self._binary_wire: bytes | None = None

    @property
    def text_wire(self) -> bytes:
        data = self._text_wire
        if data is None:
            data = self._text_wire = b"".join([frame.text_wire for frame in self.frames])
        return data

    @property
    def binary_wire(self) -> bytes:
        data = self._binary_wire
        if data is None:
            data = self._binary_wire = b"".join([frame.binary_wire for frame in self.frames])
        return data


compact_json = json.JSONEncoder(separators=(",", ":")).encode
"""JSON without spaces: the text frames', and the internal listener's answers."""
_TEXT = 0x80 | Opcode.TEXT.value  # FIN and the opcode: one frame, never fragmented
_BINARY = 0x80 | Opcode.BINARY.value


def frame_bytes(first: int, payload: bytes) -> bytes:
    """An unmasked final frame: RFC 6455 section 5.2's header, then ``payload``.

    What ``websockets.frames.Frame(...).serialize(mask=False)`` writes
    (``tests/test_protocol.py`` checks they agree), without its checks and
    extension hooks, which a server's frame without extensions never needs.
    """
    length = len(payload)
    if length < 126:
        return bytes((first, length)) + payload
    if length < 65536:
        return struct.pack("!BBH", first, 126, length) + payload
    return struct.pack("!BBQ", first, 127, length) + payload
