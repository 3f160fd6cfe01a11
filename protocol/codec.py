"""Encode server messages into frames, once per event and format.

A :class:`Frame` is built once per event and handed to every recipient. Its
JSON text (browsers) and msgpack bytes (``ap.msgpack`` clients), and the
WebSocket frames that carry them, are each produced at most once, on first use.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any

import msgpack
from websockets.frames import Frame as WireFrame
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
        games = [{"meta": meta, "id": game_id} for meta, game_id in message.games]
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
    """One server message, encoded lazily and at most once per format."""

    __slots__ = ("__dict__", "message")

    def __init__(self, message: ServerMessage) -> None:
        self.message = message

    @cached_property
    def wire(self) -> dict[str, Any]:
        return to_wire(self.message)

    @cached_property
    def text(self) -> str:
        """The JSON text frame."""
        return json.dumps(self.wire, separators=(",", ":"))

    @cached_property
    def text_utf8(self) -> bytes:
        """The JSON text frame's UTF-8 bytes, ready for the socket."""
        return self.text.encode()

    @cached_property
    def binary(self) -> bytes:
        """The msgpack binary frame."""
        data: bytes = msgpack.packb(self.wire, use_bin_type=True)
        return data

    # A server frame is never masked, so without extensions its bytes on the wire
    # are the same for every socket: frame it once, write it to each.

    @cached_property
    def text_wire(self) -> bytes:
        """The complete WebSocket text frame (header and payload), unmasked."""
        return WireFrame(Opcode.TEXT, self.text_utf8).serialize(mask=False)

    @cached_property
    def binary_wire(self) -> bytes:
        """The complete WebSocket binary frame (header and payload), unmasked."""
        return WireFrame(Opcode.BINARY, self.binary).serialize(mask=False)
