"""A bot to try locally: its ``BOT`` row and one game where it is to move.

``ap-realtime seed-bot --client-id ID`` writes them to a DynamoDB endpoint;
``serve --dev-bot ID`` to the embedded store at start. The game is also left as
the bot's candidate (``BOTTURNS#``), as a ``move`` message of the bot queue
would leave it, so the bot's first ``pendingTurns`` names it
(``docs/bots.md``, "Five minutes").
"""

from __future__ import annotations

import time

import aioboto3

from server.aws import client_config
from server.store import records as r
from server.store.base import BOT_CANDIDATE_TTL_SECONDS, BotRecord, CurrentGame, StoreUnavailable
from server.store.memory import MemoryStore

DEV_META = "chess"
DEV_OPPONENT = "dev-human"


def dev_game_id(client_id: str) -> str:
    return f"dev-game-{client_id}"


def dev_game(client_id: str) -> CurrentGame:
    """Two players, the bot first and to move (``toMove`` "0")."""
    return CurrentGame(dev_game_id(client_id), DEV_META, (client_id, DEV_OPPONENT), "0")


def seed_memory(store: MemoryStore, client_id: str) -> None:
    store.put_bot(BotRecord(client_id=client_id, name=f"dev bot {client_id}", owner=DEV_OPPONENT))
    game = dev_game(client_id)
    store.put_game(game)
    now_ms = int(time.time() * 1000)
    store.put_row(
        r.BOTTURNS_PREFIX + client_id,
        game.game_id,
        {r.META_GAME: game.meta, r.ADDED_AT: now_ms, r.TTL: now_ms // 1000 + 86_400},
    )


def _typed_items(client_id: str, now_ms: int) -> list[dict[str, dict[str, object]]]:
    game = dev_game(client_id)

    def s(value: str) -> dict[str, object]:
        return {"S": value}

    def n(value: int) -> dict[str, object]:
        return {"N": str(value)}

    players = [
        {"M": {r.PLAYER_ID: s(p), "name": s(p), "time": n(86_400_000)}} for p in game.player_ids
    ]
    return [
        {  # as the backend's createBot writes it
            "pk": s(r.BOT_PK),
            "sk": s(client_id),
            "name": s(f"dev bot {client_id}"),
            "endpoint": s("https://localhost.invalid/webhook"),
            "owner": s(DEV_OPPONENT),
            "lastseen": n(now_ms),
        },
        {  # the fields of a GAME row that routing reads
            "pk": s(r.GAME_PK),
            "sk": s(r.game_sk(game.meta, game.game_id, completed=False)),
            "id": s(game.game_id),
            r.META_GAME: s(game.meta),
            r.PLAYERS: {"L": players},
            "toMove": s("0"),
            "numPlayers": n(2),
        },
        {
            "pk": s(r.BOTTURNS_PREFIX + client_id),
            "sk": s(game.game_id),
            r.META_GAME: s(game.meta),
            r.ADDED_AT: n(now_ms),
            r.TTL: n(now_ms // 1000 + BOT_CANDIDATE_TTL_SECONDS),
        },
    ]


async def seed_dynamodb(
    endpoint_url: str | None, table: str, region: str, client_id: str
) -> tuple[str, str]:
    """Write the three rows; returns the game's (meta, id). Raises StoreUnavailable."""
    now_ms = int(time.time() * 1000)
    try:
        async with aioboto3.Session().client(
            "dynamodb", endpoint_url=endpoint_url, region_name=region, config=client_config()
        ) as client:
            for item in _typed_items(client_id, now_ms):
                await client.put_item(TableName=table, Item=item)
    except Exception as exc:
        raise StoreUnavailable(f"could not write to table {table!r}: {exc}") from exc
    return DEV_META, dev_game_id(client_id)
