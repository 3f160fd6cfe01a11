"""Reads of the backend's rows (``BOT``, ``CURRENTGAMES#``), on every Store.

The rows are seeded the way the backend writes them: for DynamoDB with plain
boto3 in their real shapes, for the memory store with its seeding methods.
"""

from __future__ import annotations

from typing import Any

import boto3

from server.store import BotRecord, CurrentGame, MemoryStore, Store
from server.store.dynamodb import DynamoStore
from tests.conftest import TEST_REGION


def _raw(store: DynamoStore) -> Any:
    return boto3.client("dynamodb", endpoint_url=store.endpoint_url, region_name=TEST_REGION)


def seed_bot(store: Store, bot: BotRecord) -> None:
    if isinstance(store, MemoryStore):
        store.put_bot(bot)
        return
    assert isinstance(store, DynamoStore)
    _raw(store).put_item(
        TableName=store.table,
        Item={
            "pk": {"S": "BOT"},
            "sk": {"S": bot.client_id},
            "name": {"S": bot.name},
            "owner": {"S": bot.owner},
            "endpoint": {"S": "https://bot.example/hook"},
            "lastseen": {"N": "1764500000000"},
        },
    )


def seed_game(store: Store, user_id: str, game: CurrentGame) -> None:
    if isinstance(store, MemoryStore):
        store.put_current_game(user_id, game)
        return
    assert isinstance(store, DynamoStore)
    to_move: dict[str, Any]
    if isinstance(game.to_move, tuple):
        to_move = {"L": [{"BOOL": flag} for flag in game.to_move]}
    else:
        to_move = {"S": str(game.to_move)}
    players = [
        {"M": {"id": {"S": pid}, "name": {"S": pid.upper()}, "time": {"N": "3600000"}}}
        for pid in game.player_ids
    ]
    _raw(store).put_item(
        TableName=store.table,
        Item={
            "pk": {"S": f"CURRENTGAMES#{user_id}"},
            "sk": {"S": game.game_id},
            "id": {"S": game.game_id},
            "metaGame": {"S": game.meta},
            "players": {"L": players},
            "toMove": to_move,
            "clockHard": {"BOOL": True},
            "lastMoveTime": {"N": "1764500000000"},
            "numMoves": {"N": "3"},
        },
    )


async def test_get_bot_finds_the_row_and_only_it(store: Store) -> None:
    seed_bot(store, BotRecord(client_id="client-a", name="Alpha", owner="owner-1"))
    assert await store.get_bot("client-a") == BotRecord("client-a", "Alpha", "owner-1")
    assert await store.get_bot("client-b") is None


async def test_current_games_reads_every_row_of_the_user(store: Store) -> None:
    mine = [
        CurrentGame("g-1", "chess", ("bot", "alice"), "0"),
        CurrentGame("g-2", "go", ("alice", "bot", "carol"), (False, True, False)),
    ]
    for game in mine:
        seed_game(store, "bot", game)
    seed_game(store, "alice", CurrentGame("g-3", "chess", ("alice", "bob"), "1"))
    assert sorted(await store.current_games("bot"), key=lambda g: g.game_id) == mine
    assert await store.current_games("nobody") == []


async def test_current_games_follows_pages(store: Store) -> None:
    # ~150 rows of ~8 KB: more than one 1 MB Query page on DynamoDB.
    players = (*(f"player-{n:04d}-" + "x" * 100 for n in range(60)), "bot")
    for n in range(150):
        seed_game(store, "bot", CurrentGame(f"g-{n:03d}", "chess", players, "60"))
    games = await store.current_games("bot")
    assert len(games) == 150 and {g.game_id for g in games} == {f"g-{n:03d}" for n in range(150)}
    assert all(g.player_ids[60] == "bot" and g.to_move == "60" for g in games)
