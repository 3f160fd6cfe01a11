"""Bots over WebSocket: bot tokens vs human tokens, the BOT row, pendingTurns,
presence, and the per-node connection limit. End to end over real sockets, with
both pools' JWKS served over real HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio

from loadtest.harness.faults import TcpFaultProxy
from protocol.errors import MAX_WATCHED_GAMES
from server.config import Settings
from server.coordination.bot_sessions import sessions_key
from server.services.bots import PRUNE_GRACE_MS
from server.store import BotRecord, CurrentGame, MemoryStore
from server.store.dynamodb import DynamoStore
from tests.client import Client
from tests.conftest import TEST_REGION, TEST_SETTINGS, RunningServer, on_dynamodb, run_server
from tests.services import DynamoFaultProxy, RedisServer
from tests.tokens import BOT_SCOPE, HUMAN_CLIENT_ID, JwksServer, Pool
from tests.waiting import eventually, eventually_read

BOT = "bot-client-1"


@dataclass
class World:
    server: RunningServer
    store: MemoryStore
    humans: Pool
    bots: Pool
    jwks: JwksServer

    async def bot(self, token: str | None = None) -> Client:
        client = await self.server.client()
        await client.send({"action": "subscribe", "token": token or self.bots.bot_token(BOT)})
        return client


def game(game_id: str, players: list[str], to_move: str | tuple[bool, ...]) -> CurrentGame:
    return CurrentGame(game_id=game_id, meta="chess", player_ids=tuple(players), to_move=to_move)


@pytest.fixture
async def jwks() -> AsyncIterator[JwksServer]:
    server = JwksServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def two_bots() -> MemoryStore:
    """A store whose ``BOT`` rows register two bots: ``BOT`` and ``bot-2``."""
    store = MemoryStore()
    store.put_bot(BotRecord(client_id=BOT, name="Tester", owner="owner-1"))
    store.put_bot(BotRecord(client_id="bot-2", name="Other", owner="owner-1"))
    return store


@pytest.fixture
async def world(jwks: JwksServer, request: pytest.FixtureRequest) -> AsyncIterator[World]:
    humans, bots = jwks.pool("humans"), jwks.pool("bots")
    store = two_bots()
    settings = dataclasses.replace(
        TEST_SETTINGS,
        cognito_issuer=humans.issuer,
        cognito_client_id=HUMAN_CLIENT_ID,
        bot_cognito_issuer=bots.issuer,
        bot_scope=BOT_SCOPE,
        **getattr(request, "param", {}),
    )
    async with run_server(settings, store) as server:
        yield World(server, store, humans, bots, jwks)


def pending(message: dict[str, Any]) -> set[tuple[str, str]]:
    return {(g["meta"], g["id"]) for g in message["payload"]["games"]}


async def pending_turns(client: Client) -> set[tuple[str, str]]:
    return pending(await client.next_message(lambda m: m["verb"] == "pendingTurns"))


async def test_pending_turns_list_every_game_where_the_bot_is_to_move(world: World) -> None:
    for row in [
        game("g-mine", ["alice", BOT], "1"),
        game("g-theirs", ["alice", BOT], "0"),
        game("g-simul-mine", [BOT, "bob", "carol"], (False, True, True)),
        game("g-simul-mine-2", [BOT, "bob"], (True, False)),
        game("g-simul-done", [BOT, "bob"], (False, True)),
        game("g-bad-index", [BOT, "bob"], "7"),
        game("g-not-a-number", [BOT, "bob"], "first"),  # a row no backend writes
    ]:
        world.store.put_current_game(BOT, row)
    world.store.put_current_game("alice", game("g-alice-only", ["alice", "bob"], "0"))
    bot = await world.bot()
    assert await pending_turns(bot) == {("chess", "g-mine"), ("chess", "g-simul-mine-2")}
    # simultaneous: index 0 is the bot, whose flag is False in g-simul-mine
    assert world.server.node.index.by_user[BOT]


async def test_a_bot_watches_all_its_current_games_without_watch_games(world: World) -> None:
    world.store.put_current_game(BOT, game("g1", ["alice", BOT], "0"))
    world.store.put_current_game(BOT, game("g2", [BOT, "bob"], "1"))
    bot = await world.bot()
    assert await pending_turns(bot) == set()
    for game_id in ("g-other", "g2", "g1"):
        status, _ = await world.server.publish(
            {"verb": "game", "payload": {"meta": "chess", "id": game_id}}
        )
        assert status == 202
    await bot.next_message(lambda m: m["verb"] == "game" and m["payload"]["id"] == "g1")
    got = [m["payload"]["id"] for m in bot.of_verb("game")]
    assert got == ["g2", "g1"]  # not g-other: a bot is never a legacy "every game" client
    connection_id = next(iter(world.server.node.index.by_user[BOT])).connection_id
    # The row is written behind delivery (the pacer): wait for it, with a deadline.
    deadline = asyncio.get_running_loop().time() + 10
    while (row := await world.store.get_connection(connection_id)) is None:
        assert asyncio.get_running_loop().time() < deadline, "no wsConnections row in 10 s"
        await asyncio.sleep(0.05)
    assert row.watching_games == {"chess#g1", "chess#g2"}
    assert row.wants_presence is False and row.watch_version == 1


async def test_bots_are_not_in_presence_and_get_no_presence_frames(world: World) -> None:
    alice = await world.server.subscribed("alice", token=world.humans.id_token("alice"))
    bot = await world.bot()
    await pending_turns(bot)
    await asyncio.sleep(TEST_SETTINGS.presence_debounce * 3)
    await alice.sync_presence()
    assert alice.presence.visible == {"alice"}
    assert alice.presence.server_total == 1
    assert world.server.node.presence.local.user_count == 1
    # a presence change reaches humans, and still not the bot
    await world.server.subscribed("bob", token=world.humans.id_token("bob"))
    await alice.wait_for(lambda: "bob" in alice.presence.visible)
    await bot.close()
    await asyncio.sleep(TEST_SETTINGS.presence_debounce * 3)
    assert bot.of_verb("connections") == []
    assert alice.presence.server_total == 2


async def test_a_bot_that_asks_for_presence_gets_it(world: World) -> None:
    await world.server.subscribed("alice", token=world.humans.id_token("alice"))
    bot = await world.server.client()
    await bot.send(
        {"action": "subscribe", "token": world.bots.bot_token(BOT), "wantsPresence": True}
    )
    await pending_turns(bot)
    snapshot = (await bot.next_message(lambda m: m["verb"] == "connections"))["payload"]
    assert snapshot["type"] == "snapshot" and BOT not in snapshot["visibleUserIds"]


async def test_human_and_bot_tokens_are_told_apart(world: World) -> None:
    alice = await world.server.subscribed("alice", token=world.humans.id_token("alice"))
    session = next(iter(world.server.node.index.by_user["alice"]))
    assert session.kind == "human" and not session.is_bot
    bot = await world.bot()
    await pending_turns(bot)
    assert next(iter(world.server.node.index.by_user[BOT])).kind == "bot"
    assert alice.of_verb("pendingTurns") == []


REFUSED = [
    ("no scope", lambda p: p.bot_token(BOT, scope=None), "scope"),
    ("another scope", lambda p: p.bot_token(BOT, scope="aws.cognito.signin.user.admin"), "scope"),
    ("scope is a prefix", lambda p: p.bot_token(BOT, scope=BOT_SCOPE + "x"), "scope"),
    ("id token of the bot pool", lambda p: p.bot_token(BOT, token_use="id"), "access token"),
    ("no token_use", lambda p: p.bot_token(BOT, token_use=None), "access token"),
    ("expired", lambda p: p.bot_token(BOT, exp=1_000_000), "expired"),
    ("client_id is not sub", lambda p: p.bot_token(BOT, client_id="bot-2"), "client_id"),
    ("unknown BOT row", lambda p: p.bot_token("bot-nobody"), "no bot is registered"),
]


@pytest.mark.parametrize(("case", "token", "reason"), REFUSED, ids=[c[0] for c in REFUSED])
async def test_bad_bot_tokens_are_refused(world: World, case: str, token: Any, reason: str) -> None:
    client = await world.bot(token(world.bots))
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "unauthorized"
    assert reason in error["payload"]["message"]
    assert (await client.closed())[0] == 1008
    assert BOT not in world.server.node.index.by_user


async def test_a_human_token_is_never_a_bot_token_and_back(world: World) -> None:
    cases = [
        # a human access token (right pool and key, wrong kind)
        (world.humans.id_token("alice", token_use="access"), "not an ID token"),
        # bot claims signed by the human pool's key: the bot pool does not know it
        (world.humans.sign({**_claims(world.bots), "sub": BOT}, kid="key-1"), None),
        # a bot token whose iss names the human pool
        (world.bots.bot_token(BOT, iss=world.humans.issuer), None),
        # a human ID token claiming the bot pool as issuer
        (world.humans.id_token("alice", iss=world.bots.issuer), None),
    ]
    for token, reason in cases:
        client = await world.bot(token)
        error = await client.next_message(lambda m: m["verb"] == "error")
        assert error["payload"]["code"] == "unauthorized", error
        if reason is not None:
            assert reason in error["payload"]["message"]
        assert (await client.closed())[0] == 1008
    assert set(world.server.node.index.by_user) == set()


def _claims(pool: Pool) -> dict[str, Any]:
    import jwt

    return dict(jwt.decode(pool.bot_token(BOT), options={"verify_signature": False}))


@pytest.mark.parametrize("world", [{"bot_max_connections": 2}], indirect=True)
async def test_a_bot_may_hold_at_most_max_connections(world: World) -> None:
    first, second = await world.bot(), await world.bot()
    await pending_turns(first)
    await pending_turns(second)
    third = await world.bot()
    error = await third.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "too_many_connections"
    assert "at most 2" in error["payload"]["message"]
    assert (await third.closed())[0] == 4509
    other = await world.bot(world.bots.bot_token("bot-2"))  # the limit is per bot
    await pending_turns(other)
    await first.close()
    node = world.server.node
    await eventually(lambda: len(node.index.by_user[BOT]) == 1, 5, "the closed socket to leave")
    fourth = await world.bot()
    assert await pending_turns(fourth) == set()
    assert len(world.server.node.index.by_user[BOT]) == 2


async def test_the_bot_pool_being_unreachable_is_a_clear_try_again(world: World) -> None:
    await world.jwks.stop()
    client = await world.bot()
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "unavailable"
    assert world.bots.issuer + "/.well-known/jwks.json" in error["payload"]["message"]
    assert (await client.closed())[0] == 1013


# ------------------------------------------------------------------ DynamoDB


def _put_current_game(raw: Any, table: str, player: str, game_id: str, to_move: Any) -> None:
    """A CURRENTGAMES# row as the backend's game projector writes it."""
    players = [("alice", "Alice"), (BOT, "Tester"), ("bob", "Bob")]
    raw.put_item(
        TableName=table,
        Item={
            "pk": {"S": f"CURRENTGAMES#{player}"},
            "sk": {"S": game_id},
            "id": {"S": game_id},
            "metaGame": {"S": "homeworlds"},
            "players": {
                "L": [
                    {"M": {"id": {"S": pid}, "name": {"S": name}, "time": {"N": "86400000"}}}
                    for pid, name in players
                ]
            },
            "clockHard": {"BOOL": False},
            "noExplore": {"BOOL": False},
            "toMove": to_move,
            "lastMoveTime": {"N": "1764500000000"},
            "variants": {"L": [{"S": "quick"}]},
            "gameStarted": {"N": "1764400000000"},
            "numMoves": {"N": "12"},
        },
    )


def put_bot_row(raw: Any, table: str) -> None:
    """The smallest ``BOT`` row the backend's create_bot writes."""
    raw.put_item(
        TableName=table,
        Item={"pk": {"S": "BOT"}, "sk": {"S": BOT}, "name": {"S": "T"}, "owner": {"S": "o"}},
    )


def bots_on_dynamodb(bots: Pool, proxy: DynamoFaultProxy, table: str) -> Settings:
    """A node taking the bot pool's tokens, its store the table behind ``proxy``."""
    return on_dynamodb(proxy.endpoint, table, bot_cognito_issuer=bots.issuer, bot_scope=BOT_SCOPE)


async def test_pending_turns_from_currentgames_rows_in_dynamodb(
    jwks: JwksServer, dynamodb_endpoint: str, table: str, raw: Any
) -> None:
    bots = jwks.pool("bots")
    raw.put_item(
        TableName=table,
        Item={
            "pk": {"S": "BOT"},
            "sk": {"S": BOT},
            "name": {"S": "Tester"},
            "endpoint": {"S": "https://bot.example/hook"},
            "owner": {"S": "owner-1"},
            "lastseen": {"N": "1764500000000"},
            "supported": {"L": [{"M": {"meta": {"S": "homeworlds"}, "variants": {"L": []}}}]},
        },
    )
    _put_current_game(raw, table, BOT, "hw-mine", {"S": "1"})
    _put_current_game(raw, table, BOT, "hw-theirs", {"S": "2"})
    _put_current_game(
        raw, table, BOT, "hw-simul", {"L": [{"BOOL": False}, {"BOOL": True}, {"BOOL": True}]}
    )
    _put_current_game(
        raw,
        table,
        BOT,
        "hw-simul-waiting",
        {"L": [{"BOOL": True}, {"BOOL": False}, {"BOOL": True}]},
    )
    _put_current_game(raw, table, "alice", "hw-alice", {"S": "0"})
    store = DynamoStore(table=table, region=TEST_REGION, endpoint_url=dynamodb_endpoint)
    settings = dataclasses.replace(
        TEST_SETTINGS, bot_cognito_issuer=bots.issuer, bot_scope=BOT_SCOPE, store="dynamodb"
    )
    async with run_server(settings, store) as server:
        client = await server.client()
        await client.send({"action": "subscribe", "token": bots.bot_token(BOT)})
        assert await pending_turns(client) == {
            ("homeworlds", "hw-mine"),
            ("homeworlds", "hw-simul"),
        }
        unknown = await server.client()
        await unknown.send({"action": "subscribe", "token": bots.bot_token("bot-unknown")})
        error = await unknown.next_message(lambda m: m["verb"] == "error")
        assert error["payload"]["code"] == "unauthorized"
        assert (await unknown.closed())[0] == 1008


async def test_an_unreadable_bot_row_or_game_list_makes_the_bot_retry(
    jwks: JwksServer, dynamodb_proxy: DynamoFaultProxy, table: str, raw: Any
) -> None:
    """DynamoDB refuses the ``BOT`` row's read, then, on the next try, the bot's
    current games: each time the bot hears ``unavailable`` and 1013, and no
    ``pendingTurns`` (without the list it could miss a turn for good). Once
    DynamoDB answers, the bot gets its turns."""
    bots = jwks.pool("bots")
    put_bot_row(raw, table)
    _put_current_game(raw, table, BOT, "hw-mine", {"S": "1"})
    async with run_server(bots_on_dynamodb(bots, dynamodb_proxy, table)) as server:
        # Errors the store does not retry: each read fails at once.
        for operation, what in (("GetItem", "bot registry"), ("Query", "current games")):
            dynamodb_proxy.fail_operation(operation, 1, "AccessDeniedException", 400)
            client = await server.client()
            await client.send({"action": "subscribe", "token": bots.bot_token(BOT)})
            error = await client.next_message(lambda m: m["verb"] == "error")
            assert error["payload"]["code"] == "unavailable"
            assert what in error["payload"]["message"]
            assert (await client.closed())[0] == 1013
            assert client.of_verb("pendingTurns") == []
        assert dynamodb_proxy.injected == {"AccessDeniedException": 2}
        client = await server.client()
        await client.send({"action": "subscribe", "token": bots.bot_token(BOT)})
        assert await pending_turns(client) == {("homeworlds", "hw-mine")}


async def test_a_bot_whose_session_mark_fails_still_gets_its_turns_and_is_marked_soon(
    jwks: JwksServer, redis_proxy: TcpFaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis never sees the mark of a connecting bot (its connection is reset, and
    so is redis-py's retry). The bot is not refused: it gets its pendingTurns
    (the bot queue bridge writes a move's candidate before it looks for marks),
    and the next renewal marks it, so its messages come over the socket again."""
    monkeypatch.setattr("server.services.bots.MARK_SECONDS", 0.9)  # renewed every 0.3 s
    bots = jwks.pool("bots")
    store = MemoryStore()
    store.put_bot(BotRecord(client_id=BOT, name="Tester", owner="owner-1"))
    store.put_current_game(BOT, game("g-mine", [BOT, "alice"], "0"))
    settings = dataclasses.replace(
        TEST_SETTINGS,
        bot_cognito_issuer=bots.issuer,
        bot_scope=BOT_SCOPE,
        redis_url=redis_proxy.url,
    )
    async with run_server(settings, store) as server:
        redis_proxy.cut_before(sessions_key(BOT).encode(), 2)
        client = await server.client()
        await client.send({"action": "subscribe", "token": bots.bot_token(BOT)})
        assert await pending_turns(client) == {("chess", "g-mine")}
        assert redis_proxy.cuts_before_write == 2
        sessions = server.node.bots.sessions
        await eventually_read(lambda: sessions.connected(BOT), bool, 10, "the renewed mark")
        assert client.ws.close_code is None


# ------------------------------------------------------------------ turns


async def test_turns_reach_the_bot_live_with_their_stream_position(world: World) -> None:
    bot = await world.bot()
    await pending_turns(bot)
    body = {"verb": "yourTurn", "users": [BOT], "payload": {"meta": "chess", "id": "g9"}}
    status, reply = await world.server.publish(body)
    assert status == 202, reply
    message = await bot.next_message(lambda m: m["verb"] == "yourTurn")
    assert message["payload"] == {"meta": "chess", "id": "g9"}
    assert message["stream"] == f"user:{BOT}"
    assert isinstance(message["epoch"], str) and message["offset"] == 1


async def test_a_bot_whose_history_is_gone_gets_recovered_false_then_pending_turns(
    world: World,
) -> None:
    world.store.put_current_game(BOT, game("g-waiting", ["alice", BOT], "1"))
    bot = await world.server.client()
    since = {f"user:{BOT}": {"epoch": "an-epoch-long-gone", "offset": 41}}
    await bot.send({"action": "subscribe", "token": world.bots.bot_token(BOT), "since": since})
    assert await pending_turns(bot) == {("chess", "g-waiting")}
    verbs = [m["verb"] for m in bot.messages]
    recovered = bot.of_verb("recovered")
    assert len(recovered) == 1 and recovered[0]["payload"]["recovered"] is False
    assert verbs.index("recovered") < verbs.index("pendingTurns")


@pytest.mark.parametrize("world", [{"history_ttl": 1, "stream_meta_ttl": 1}], indirect=True)
async def test_a_bot_whose_stream_restarts_under_it_gets_pending_turns_again(
    world: World,
) -> None:
    world.store.put_current_game(BOT, game("g-waiting", ["alice", BOT], "1"))
    bot = await world.server.client()
    since = {f"user:{BOT}": {"epoch": "", "offset": 0}}  # speaks streams from the start
    await bot.send({"action": "subscribe", "token": world.bots.bot_token(BOT), "since": since})
    await pending_turns(bot)
    body = {"verb": "yourTurn", "users": [BOT], "payload": {"meta": "chess", "id": "g1"}}
    assert (await world.server.publish(body))[0] == 202
    first = await bot.next_message(lambda m: m["verb"] == "yourTurn")
    await asyncio.sleep(1.5)  # the stream's epoch expires: the next event starts a new one
    assert (await world.server.publish(body))[0] == 202
    await bot.wait_for(lambda: len(bot.of_verb("pendingTurns")) == 2)
    lost = [m for m in bot.of_verb("recovered") if m["payload"]["recovered"] is False]
    assert lost and lost[-1]["payload"]["epoch"] != first["epoch"]
    verbs = [m["verb"] for m in bot.messages]
    last_lost = len(verbs) - 1 - verbs[::-1].index("recovered")
    assert verbs.index("pendingTurns", last_lost) > last_lost
    assert pending(bot.of_verb("pendingTurns")[-1]) == {("chess", "g-waiting")}


@pytest.mark.parametrize("world", [{"drain_move_grace_ms": 600_000}], indirect=True)
async def test_a_drain_closes_bots_with_1012_without_a_presence_grace(world: World) -> None:
    bot = await world.bot()
    await pending_turns(bot)
    # A bot was never in presence: nothing to keep online while it moves, so the
    # drain does not wait out the (here 10 minutes) move grace for it.
    assert await asyncio.wait_for(world.server.node.drain(0.2), timeout=60) == 1
    assert (await bot.closed())[0] == 1012
    assert world.server.node.presence.local.user_count == 0
    assert world.server.node.sessions == set()


async def test_a_node_that_stops_drops_its_bots_marks_at_once(
    jwks: JwksServer, fresh_redis: RedisServer
) -> None:
    """A stopped node's bots are told to reconnect; until they have, the bot queue
    bridge must send their messages to the webhook, not to a mark that lapses only
    ``MARK_SECONDS`` later."""
    bots = jwks.pool("bots")
    store = two_bots()
    settings = dataclasses.replace(
        TEST_SETTINGS,
        bot_cognito_issuer=bots.issuer,
        bot_scope=BOT_SCOPE,
        redis_url=fresh_redis.url,
    )
    marks = redis.asyncio.Redis.from_url(fresh_redis.url)
    try:
        async with run_server(settings, store) as server:
            for bot_id in (BOT, "bot-2"):
                client = await server.client()
                await client.send({"action": "subscribe", "token": bots.bot_token(bot_id)})
                await pending_turns(client)
            assert await marks.exists(sessions_key(BOT), sessions_key("bot-2")) == 2
        assert await marks.exists(sessions_key(BOT), sessions_key("bot-2")) == 0
    finally:
        await marks.aclose()


async def test_a_bot_in_more_games_than_a_watch_set_holds_is_told_every_turn(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """Its watch set stops at the cap (the first games), and a warning says so; its
    pendingTurns still names every game where it is to move."""
    count = MAX_WATCHED_GAMES + 5
    for number in range(count):
        world.store.put_current_game(BOT, game(f"g{number:05}", ["alice", BOT], "1"))
    bot = await world.bot()
    assert await pending_turns(bot) == {("chess", f"g{number:05}") for number in range(count)}
    (session,) = world.server.node.index.by_user[BOT]
    assert len(session.watching) == MAX_WATCHED_GAMES
    assert f"more than {MAX_WATCHED_GAMES} games" in caplog.text


async def test_a_candidate_that_cannot_be_pruned_leaves_the_bots_turns_whole(
    jwks: JwksServer, dynamodb_proxy: DynamoFaultProxy, table: str, raw: Any
) -> None:
    """Pruning a stale ``BOTTURNS#`` candidate fails: the bot still gets its turns,
    the candidates stay (the rest are not tried against a failing table), and the
    next subscribe prunes them."""
    bots = jwks.pool("bots")
    put_bot_row(raw, table)
    old = str(int(time.time() * 1000) - PRUNE_GRACE_MS - 1000)
    for game_id in ("hw-turn", "hw-over-1", "hw-over-2"):
        raw.put_item(
            TableName=table,
            Item={
                "pk": {"S": f"BOTTURNS#{BOT}"},
                "sk": {"S": game_id},
                "metaGame": {"S": "homeworlds"},
                "addedAt": {"N": old},
                "ttl": {"N": str(int(time.time()) + 86400)},
            },
        )
    raw.put_item(  # the only game not over, and the bot is to move in it
        TableName=table,
        Item={
            "pk": {"S": "GAME"},
            "sk": {"S": "homeworlds#0#hw-turn"},
            "id": {"S": "hw-turn"},
            "metaGame": {"S": "homeworlds"},
            "players": {"L": [{"M": {"id": {"S": "alice"}}}, {"M": {"id": {"S": BOT}}}]},
            "toMove": {"S": "1"},
        },
    )

    def candidates() -> set[str]:
        items = raw.query(
            TableName=table,
            KeyConditionExpression="pk = :pk",
            ExpressionAttributeValues={":pk": {"S": f"BOTTURNS#{BOT}"}},
            ConsistentRead=True,
        )["Items"]
        return {item["sk"]["S"] for item in items}

    async with run_server(bots_on_dynamodb(bots, dynamodb_proxy, table)) as server:
        dynamodb_proxy.fail_operation("DeleteItem", 1, "AccessDeniedException", 400)
        client = await server.client()
        await client.send({"action": "subscribe", "token": bots.bot_token(BOT)})
        assert await pending_turns(client) == {("homeworlds", "hw-turn")}
        assert dynamodb_proxy.injected == {"AccessDeniedException": 1}
        assert dynamodb_proxy.count("DeleteItem") == 1
        assert candidates() == {"hw-turn", "hw-over-1", "hw-over-2"}
        again = await server.client()
        await again.send({"action": "subscribe", "token": bots.bot_token(BOT)})
        assert await pending_turns(again) == {("homeworlds", "hw-turn")}
        assert candidates() == {"hw-turn"}
