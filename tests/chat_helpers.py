"""Helpers for chat tests: send a comment, wait for its ack or error, seed a game."""

from __future__ import annotations

import uuid
from typing import Any

from tests.client import Client
from tests.rows import Rows


def chat_message(
    game: tuple[str, str], comment: str, *, msg_id: str | None = None, move: int = 1
) -> dict[str, Any]:
    meta, game_id = game
    return {
        "action": "chat",
        "meta": meta,
        "id": game_id,
        "comment": comment,
        "moveNumber": move,
        "clientMsgId": msg_id if msg_id is not None else uuid.uuid4().hex,
    }


def replies(client: Client, msg_id: str) -> list[dict[str, Any]]:
    """The chatAck and error frames that answer ``msg_id``, in arrival order."""
    return [
        m
        for m in client.messages
        if m.get("verb") in ("chatAck", "error")
        and isinstance(m.get("payload"), dict)
        and m["payload"].get("clientMsgId") == msg_id
    ]


async def post(
    client: Client,
    game: tuple[str, str],
    comment: str,
    *,
    msg_id: str | None = None,
    move: int = 1,
    within: float = 10.0,
) -> dict[str, Any]:
    """Send one comment; return the frame that answers it (its ack or its error)."""
    message = chat_message(game, comment, msg_id=msg_id, move=move)
    before = len(replies(client, message["clientMsgId"]))
    await client.send(message)
    await client.wait_for(lambda: len(replies(client, message["clientMsgId"])) > before, within)
    return replies(client, message["clientMsgId"])[before]


def seed_game(
    rows: Rows, game: tuple[str, str], players: list[str], *, completed: bool = False
) -> None:
    meta, game_id = game
    rows.put(
        "GAME",
        f"{meta}#{1 if completed else 0}#{game_id}",
        {"id": game_id, "metaGame": meta, "players": [{"id": p, "name": p} for p in players]},
    )


def complete_game(rows: Rows, game: tuple[str, str]) -> None:
    """End a game the backend's way: its row moves from ``#0#`` to ``#1#``."""
    meta, game_id = game
    active = rows.get("GAME", f"{meta}#0#{game_id}")
    assert active is not None, f"{game} is not an active game"
    rows.put("GAME", f"{meta}#1#{game_id}", active)
    rows.delete("GAME", f"{meta}#0#{game_id}")


def put_game_row(raw: Any, table: str, players: list[str]) -> None:
    """The ``GAME`` row of chess game g1, put with a plain boto3 client (the backend's way)."""
    raw.put_item(
        TableName=table,
        Item={
            "pk": {"S": "GAME"},
            "sk": {"S": "chess#0#g1"},
            "players": {"L": [{"M": {"id": {"S": p}}} for p in players]},
        },
    )
