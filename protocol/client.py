"""The client's side of the protocol, with no I/O: actions to send, server frames read.

:func:`parse_server_message` is the inverse of :func:`protocol.codec.to_wire`
(property-tested): every frame the server sends comes back as the message the
server built it from. A verb this code does not know (a newer server) comes
back as :class:`UnknownFrame`, never as an error, so clients keep working.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import (
    GAME_VERBS,
    Ack,
    AdminTest,
    ChatAck,
    ErrorMessage,
    GameEvent,
    Heartbeat,
    PendingTurns,
    Position,
    Positioned,
    PresenceDelta,
    PresenceSnapshot,
    Recovered,
    ServerMessage,
    Skip,
    UserEvent,
    ply_of,
)
from protocol.parse import decode_frame

# --- client -> server -----------------------------------------------------------

GameRef = tuple[str, str]
"""A game as ``(meta, id)``."""


def game_refs(games: Iterable[GameRef]) -> list[dict[str, str]]:
    return [{"meta": meta, "id": game_id} for meta, game_id in games]


def since_field(since: Mapping[str, Position]) -> dict[str, dict[str, Any]]:
    return {s: {"epoch": p.epoch, "offset": p.offset} for s, p in since.items()}


def subscribe_action(
    token: str,
    *,
    games: Iterable[GameRef] | None = None,
    since: Mapping[str, Position] | None = None,
    ack_id: str | None = None,
    heartbeat: bool = False,
    invisible: bool = False,
    wants_presence: bool | None = None,
    watch_version: int | None = 1,
) -> dict[str, Any]:
    """A ``subscribe``; fields left at their defaults are not sent."""
    action: dict[str, Any] = {"action": "subscribe", "token": token}
    if invisible:
        action["invisible"] = True
    if wants_presence is not None:
        action["wantsPresence"] = wants_presence
    if watch_version is not None:
        action["watchVersion"] = watch_version
    if games is not None:
        action["games"] = game_refs(games)
    if since is not None:
        action["since"] = since_field(since)
    if heartbeat:
        action["heartbeat"] = True
    if ack_id is not None:
        action["ackId"] = ack_id
    return action


def watch_games_action(
    games: Iterable[GameRef],
    *,
    since: Mapping[str, Position] | None = None,
    ack_id: str | None = None,
) -> dict[str, Any]:
    action: dict[str, Any] = {"action": "watchGames", "games": game_refs(games)}
    if since is not None:
        action["since"] = since_field(since)
    if ack_id is not None:
        action["ackId"] = ack_id
    return action


def sync_presence_action() -> dict[str, Any]:
    return {"action": "syncPresence"}


def encode_action(action: Mapping[str, Any], *, binary: bool = False) -> str | bytes:
    """A text frame (JSON), or a binary one (msgpack) for ``ap.msgpack`` sockets."""
    if binary:
        data: bytes = msgpack.packb(dict(action), use_bin_type=True)
        return data
    return json.dumps(action, separators=(",", ":"))


# --- server -> client -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UnknownFrame:
    """A frame of a verb this code does not know, passed on as it came."""

    verb: str
    payload: Any = field(compare=False)


ClientBound = ServerMessage | UnknownFrame


def parse_server_frame(data: str | bytes) -> ClientBound:
    """Decode and read one server frame (text: JSON, binary: msgpack)."""
    return parse_server_message(decode_frame(data))


def parse_server_message(message: Any) -> ClientBound:
    """Read a decoded server frame; :class:`ProtocolError` when it is malformed."""
    if not isinstance(message, Mapping):
        raise _bad("a server frame must be an object")
    verb = message.get("verb")
    if not isinstance(verb, str):
        raise _bad("a server frame needs a string 'verb'")
    payload = message.get("payload")
    try:
        if "stream" in message or verb == "skip":
            return _positioned(verb, message)
        return _plain(verb, payload)
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(f"malformed {verb!r} frame: {exc}") from None


def _bad(text: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_FRAME, text)


def _positioned(verb: str, message: Mapping[str, Any]) -> Positioned | Skip:
    stream, epoch, offset = message["stream"], message["epoch"], message["offset"]
    if not isinstance(stream, str) or not isinstance(epoch, str) or not _count(offset):
        raise ValueError("needs a string 'stream' and 'epoch' and a whole 'offset'")
    if verb == "skip":
        return Skip(stream, epoch, offset)
    payload = message.get("payload")
    event = _game_event(verb, payload) or UserEvent(verb, (), payload)
    return Positioned(event, stream, epoch, offset)


def _plain(verb: str, payload: Any) -> ClientBound:
    if verb == "connections":
        if payload["type"] == "snapshot":
            return PresenceSnapshot(
                seq=_int(payload["seq"]),
                total_count=_int(payload["totalCount"]),
                visible_user_ids=tuple(_strings(payload["visibleUserIds"])),
            )
        if payload["type"] == "delta":
            return PresenceDelta(
                seq=_int(payload["seq"]),
                joins=tuple(_strings(payload["joins"])),
                leaves=tuple(_strings(payload["leaves"])),
                # Servers before totalCount: -1, the client keeps its own count.
                total_count=_int(payload.get("totalCount", -1), minimum=-1),
            )
        raise ValueError(f"unknown type {payload['type']!r}")
    if verb == "recovered":
        return Recovered(
            stream=_str(payload["stream"]),
            recovered=_bool(payload["recovered"]),
            epoch=_str(payload["epoch"]),
            offset=_int(payload["offset"]),
        )
    if verb == "ack":
        action = payload["action"]
        if action not in ("subscribe", "watchGames"):
            raise ValueError(f"unknown action {action!r}")
        beat = payload.get("heartbeatSeconds")
        return Ack(_str(payload["ackId"]), action, None if beat is None else _int(beat))
    if verb == "heartbeat":
        return Heartbeat()
    if verb == "error":
        return ErrorMessage(
            code=_str(payload["code"]),
            message=_str(payload["message"]),
            client_msg_id=_optional_str(payload.get("clientMsgId")),
            ack_id=_optional_str(payload.get("ackId")),
        )
    if verb == "chatAck":
        return ChatAck(_str(payload["clientMsgId"]), _int(payload["timeStamp"]))
    if verb == "pendingTurns":
        games = payload["games"]
        if not isinstance(games, list):
            raise ValueError("'games' must be a list")
        refs = tuple((_str(g["meta"]), _str(g["id"])) for g in games)
        plies = tuple(ply_of(g) for g in games)
        return PendingTurns(refs, plies if any(p is not None for p in plies) else ())
    if verb == "test":
        return AdminTest(payload)
    # unpositioned: a legacy route, or Redis away when it was published
    return _game_event(verb, payload) or UnknownFrame(verb, payload)


def _game_event(verb: str, payload: Any) -> GameEvent | None:
    if verb not in GAME_VERBS or not isinstance(payload, dict):
        return None
    meta, game_id = payload.get("meta"), payload.get("id")
    if not isinstance(meta, str) or not isinstance(game_id, str):
        return None
    return GameEvent("game" if verb == "game" else "chat", meta, game_id, payload)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int(value: Any, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{value!r} is not a whole number from {minimum}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def _optional_str(value: Any) -> str | None:
    return None if value is None else _str(value)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise ValueError("not a list")
    return [_str(item) for item in value]
