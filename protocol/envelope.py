"""Envelopes that cross the bus between nodes: msgpack maps with a version.

Unknown versions and kinds are refused with :class:`EnvelopeError`, so a
node running older code drops what it cannot read instead of misreading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.messages import AdminTest, Broadcast, GameEvent, PresenceDelta

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
            "verb": event.verb if isinstance(event, GameEvent) else "test",
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
