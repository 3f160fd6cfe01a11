"""Envelopes that cross the bus between nodes: msgpack maps with a version.

Unknown versions and kinds are refused with :class:`EnvelopeError`, so a
node running older code drops what it cannot read instead of misreading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.messages import (
    USER_VERBS,
    AdminTest,
    Broadcast,
    GameEvent,
    PresenceDelta,
    UserEvent,
)

ENVELOPE_VERSION = 1


class EnvelopeError(Exception):
    """An envelope could not be decoded."""


@dataclass(frozen=True, slots=True)
class PresenceHint:
    """A node's users changed state; the presence writer should look at them."""

    node_id: str
    user_ids: tuple[str, ...]
    # When the first of these changes happened (epoch seconds), so the writer's
    # debounce window starts then and not when the hint arrives. None: unknown.
    changed_at: float | None = None


Envelope = Broadcast | PresenceDelta | PresenceHint


def encode_envelope(envelope: Envelope) -> bytes:
    body: dict[str, Any]
    if isinstance(envelope, Broadcast):
        event = envelope.event
        body = {
            "k": "event",
            "verb": event.verb if isinstance(event, GameEvent | UserEvent) else "test",
            "payload": event.payload,
            "exclude": sorted(envelope.exclude),
        }
    elif isinstance(envelope, PresenceDelta):
        body = {
            "k": "delta",
            "seq": envelope.seq,
            "joins": list(envelope.joins),
            "leaves": list(envelope.leaves),
            "total": envelope.total_count,
        }
    else:
        body = {"k": "hint", "node": envelope.node_id, "users": list(envelope.user_ids)}
        if envelope.changed_at is not None:
            body["at"] = envelope.changed_at
    body["v"] = ENVELOPE_VERSION
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def decode_envelope(data: bytes) -> Envelope:
    try:
        body = msgpack.unpackb(data, raw=False)
        if not isinstance(body, dict) or body.get("v") != ENVELOPE_VERSION:
            raise EnvelopeError(f"unsupported envelope version {body.get('v')!r}")
        kind = body["k"]
        if kind == "event":
            verb, payload = body["verb"], body["payload"]
            exclude = frozenset(body["exclude"])
            if verb == "test":
                return Broadcast(event=AdminTest(payload=payload), exclude=exclude)
            if verb in USER_VERBS:
                # The recipient is the user of the stream the event travels on.
                return Broadcast(event=UserEvent(verb, (), payload), exclude=exclude)
            event = GameEvent(
                verb="game" if verb == "game" else "chat",
                meta=payload["meta"],
                game_id=payload["id"],
                payload=payload,
            )
            return Broadcast(event=event, exclude=exclude)
        if kind == "delta":
            return PresenceDelta(
                seq=int(body["seq"]),
                joins=tuple(body["joins"]),
                leaves=tuple(body["leaves"]),
                total_count=int(body["total"]),
            )
        if kind == "hint":
            at = body.get("at")
            return PresenceHint(
                node_id=body["node"],
                user_ids=tuple(body["users"]),
                changed_at=float(at) if isinstance(at, int | float) else None,
            )
        raise EnvelopeError(f"unknown envelope kind {kind!r}")
    except EnvelopeError:
        raise
    except Exception as exc:
        raise EnvelopeError(f"malformed envelope: {exc}") from None


# --- positioned messages --------------------------------------------------------
#
# A stream event crosses the bus as ``0x00 epoch 0x00 offset 0x00 envelope``:
# the position is prefixed by the Redis Lua script that assigns it, with plain
# string concatenation (no msgpack in Lua). A bare envelope is a msgpack map,
# which never starts with 0x00, so both kinds share one channel unambiguously.

POSITIONED_MARK = b"\x00"


@dataclass(frozen=True, slots=True)
class PositionedData:
    """A stream event as it crossed the bus: its position and its envelope bytes."""

    epoch: str
    offset: int
    data: bytes


def encode_positioned(epoch: str, offset: int, data: bytes) -> bytes:
    return b"".join((POSITIONED_MARK, epoch.encode(), b"\x00", str(offset).encode(), b"\x00", data))


def is_positioned(raw: bytes) -> bool:
    return raw[:1] == POSITIONED_MARK


def decode_positioned(raw: bytes) -> PositionedData:
    try:
        _, epoch, offset, data = raw.split(b"\x00", 3)
        return PositionedData(epoch.decode(), int(offset), data)
    except ValueError as exc:
        raise EnvelopeError(f"malformed positioned message: {exc}") from None
