"""Presence kept as the live browser keeps it: a snapshot replaces, deltas apply in
seq order, a gap asks for a snapshot (``syncPresence``). No I/O."""

from __future__ import annotations

from apclient.events import Presence
from protocol.messages import PresenceDelta, PresenceSnapshot


def apply_presence(
    current: Presence | None, message: PresenceSnapshot | PresenceDelta
) -> tuple[Presence | None, bool]:
    """The presence after ``message``, and whether a gap was seen (the caller then
    sends ``syncPresence``). A delta at or below the current seq changes nothing."""
    if isinstance(message, PresenceSnapshot):
        return Presence(
            message.seq, message.total_count, frozenset(message.visible_user_ids)
        ), False
    if current is None:
        return None, True
    if message.seq <= current.seq:
        return current, False
    if message.seq > current.seq + 1:
        return current, True
    visible = (current.visible_user_ids - frozenset(message.leaves)) | frozenset(message.joins)
    total = message.total_count
    if total < 0:  # a server that sends no totalCount: count as the browser does
        total = max(0, current.total_count + len(message.joins) - len(message.leaves))
    return Presence(message.seq, total, visible), False
