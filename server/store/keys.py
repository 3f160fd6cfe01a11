"""Keys and attribute names of the rows the server reads and writes.

``wsConnections`` and ``wsMeta`` are its own; ``BOT`` and ``CURRENTGAMES#`` are
the backend's, read only.

The rows live in Abstract Play's single table, next to every other record, so
their shape is fixed by what is deployed today (``docs/access-patterns.md``).
Items are in the low-level client's typed form: ``{"S": ...}``, ``{"N": ...}``,
``{"BOOL": ...}``, ``{"SS": [...]}``.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from server.store.base import BotRecord, ConnectionRecord, CurrentGame, ToMove

AttributeValue = dict[str, Any]
"""One typed attribute value, e.g. ``{"S": "abc"}``."""

Item = dict[str, AttributeValue]
"""A whole item (or key) in typed form."""

# Key values.
CONNECTIONS_PK = "wsConnections"
META_PK = "wsMeta"
PRESENCE_SEQ_SK = "presenceSeq"

NOTIFICATION_STREAM_SK = "notificationStream"
STREAM_SHARD_SK_PREFIX = "streamShard#"

# Key attributes (both strings).
PK = "pk"
SK = "sk"

# wsConnections attributes.
CONNECTION_ID = "connectionId"
USER_ID = "userId"
INVISIBLE = "invisible"
ENDPOINT = "endpoint"
WANTS_PRESENCE = "wantsPresence"
WATCH_VERSION = "watchVersion"
WATCHING_GAMES = "watchingGames"
TTL = "ttl"

# wsMeta/presenceSeq attribute.
SEQ = "seq"

# wsMeta/notificationStream and wsMeta/streamShard#<shardId> attributes.
STREAM_ARN = "streamArn"
STARTED_AT = "startedAt"
FENCE = "fence"
SEQUENCE_NUMBER = "sequenceNumber"
DONE = "done"
SHARD_ID = "shardId"
# BOT rows (pk BOT, sk <clientId>) and their attributes.
BOT_PK = "BOT"
BOT_NAME = "name"
BOT_OWNER = "owner"

# CURRENTGAMES#<userId> rows (sk <gameId>): the dashboard summary of a game.
CURRENT_GAMES_PREFIX = "CURRENTGAMES#"
GAME_ID = "id"
META_GAME = "metaGame"
PLAYERS = "players"
PLAYER_ID = "id"
TO_MOVE = "toMove"


def connection_key(connection_id: str) -> Item:
    """The primary key of one connection row."""
    return {PK: {"S": CONNECTIONS_PK}, SK: {"S": connection_id}}


def presence_seq_key() -> Item:
    """The primary key of the presence sequence counter."""
    return {PK: {"S": META_PK}, SK: {"S": PRESENCE_SEQ_SK}}


def notification_stream_key() -> Item:
    """The primary key of the stream reader's row (fence, first start)."""
    return {PK: {"S": META_PK}, SK: {"S": NOTIFICATION_STREAM_SK}}


def stream_shard_key(shard_id: str) -> Item:
    """The primary key of one shard's checkpoint."""
    return {PK: {"S": META_PK}, SK: {"S": STREAM_SHARD_SK_PREFIX + shard_id}}


def number(value: int) -> AttributeValue:
    """An ``N`` attribute for an integer."""
    return {"N": str(int(value))}


def string_set(values: frozenset[str]) -> AttributeValue:
    """An ``SS`` attribute; callers must not pass an empty set (DynamoDB rejects it)."""
    if not values:
        raise ValueError("DynamoDB has no empty sets; remove the attribute instead")
    return {"SS": sorted(values)}


def to_item(record: ConnectionRecord) -> Item:
    """The whole ``wsConnections`` row for a record.

    ``watchVersion`` is absent when None and ``watchingGames`` is absent when
    the set is empty, as in the rows written today.
    """
    item: Item = {
        **connection_key(record.connection_id),
        CONNECTION_ID: {"S": record.connection_id},
        USER_ID: {"S": record.user_id},
        INVISIBLE: {"BOOL": record.invisible},
        ENDPOINT: {"S": record.endpoint},
        WANTS_PRESENCE: {"BOOL": record.wants_presence},
        TTL: number(record.ttl),
    }
    if record.watch_version is not None:
        item[WATCH_VERSION] = number(record.watch_version)
    if record.watching_games:
        item[WATCHING_GAMES] = string_set(record.watching_games)
    return item


def parse_int(value: AttributeValue | None) -> int | None:
    """An ``N`` attribute as an int (fractions truncated), None when absent or not a number."""
    if value is None or "N" not in value:
        return None
    try:
        return int(Decimal(value["N"]))
    except (InvalidOperation, ValueError):
        return None


def _bool(value: AttributeValue | None, default: bool) -> bool:
    if value is None:
        return default
    if "BOOL" in value:
        return bool(value["BOOL"])
    if "N" in value:  # tolerate 0/1 written by hand
        return parse_int(value) not in (None, 0)
    return default


def _string(value: AttributeValue | None, default: str) -> str:
    if value is None or "S" not in value:
        return default
    return str(value["S"])


def from_item(item: Item) -> ConnectionRecord:
    """The record for a ``wsConnections`` row.

    Optional attributes take today's defaults when absent: ``invisible`` false,
    ``wantsPresence`` true, ``watchVersion`` None, ``watchingGames`` empty. A row
    without a ``ttl`` reads as ttl 0, i.e. already expired: DynamoDB would never
    delete it, so it cannot belong to a live connection. Raises ValueError when
    the row has no connection id or no user id.
    """
    connection_id = _string(item.get(CONNECTION_ID), "") or _string(item.get(SK), "")
    user_id = _string(item.get(USER_ID), "")
    if not connection_id or not user_id:
        raise ValueError(f"not a connection row (no connection id or user id): {item!r}")
    games = item.get(WATCHING_GAMES)
    return ConnectionRecord(
        connection_id=connection_id,
        user_id=user_id,
        invisible=_bool(item.get(INVISIBLE), False),
        endpoint=_string(item.get(ENDPOINT), ""),
        wants_presence=_bool(item.get(WANTS_PRESENCE), True),
        watch_version=parse_int(item.get(WATCH_VERSION)),
        watching_games=frozenset(games.get("SS", ())) if games else frozenset(),
        ttl=parse_int(item.get(TTL)) or 0,
    )


def bot_key(client_id: str) -> Item:
    """The primary key of one bot's ``BOT`` row."""
    return {PK: {"S": BOT_PK}, SK: {"S": client_id}}


def bot_from_item(item: Item) -> BotRecord:
    return BotRecord(
        client_id=_string(item.get(SK), ""),
        name=_string(item.get(BOT_NAME), ""),
        owner=_string(item.get(BOT_OWNER), ""),
    )


def current_games_pk(user_id: str) -> str:
    return f"{CURRENT_GAMES_PREFIX}{user_id}"


def _to_move(value: AttributeValue | None) -> ToMove:
    if value is None:
        return None
    if "S" in value:
        return str(value["S"])
    if "L" in value:  # simultaneous games: one flag per player
        return tuple(bool(entry.get("BOOL", False)) for entry in value["L"])
    return None


def _player_ids(value: AttributeValue | None) -> tuple[str, ...]:
    if value is None or "L" not in value:
        return ()
    ids: list[str] = []
    for entry in value["L"]:
        player = entry.get("M", {})
        ids.append(_string(player.get(PLAYER_ID), ""))
    return tuple(ids)


def current_game_from_item(item: Item) -> CurrentGame | None:
    """A ``CURRENTGAMES#`` row, or None without a game id or metaGame."""
    game_id = _string(item.get(GAME_ID), "") or _string(item.get(SK), "")
    meta = _string(item.get(META_GAME), "")
    if not game_id or not meta:
        return None
    return CurrentGame(
        game_id=game_id,
        meta=meta,
        player_ids=_player_ids(item.get(PLAYERS)),
        to_move=_to_move(item.get(TO_MOVE)),
    )
