"""The Python SDK against a real node on real sockets: every close code of the policy,
recovery, exactly-once delivery, positions, tokens, setGames and liveness.

``rand=lambda: 0.0`` pins the jitter to the bottom of each window (0 s for a
1012, 0.5 s for a backoff step, 5 s for overload), so the waits asserted are
the SDK's own timers; every other wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from apclient import (
    ClientStopped,
    Disconnected,
    Event,
    FileStorage,
    GamesRefused,
    PresenceChange,
    RealtimeClient,
)
from apclient.policy import OVERLOAD_MIN
from protocol.errors import CloseCode
from server.store import BotRecord, CurrentGame, MemoryStore
from tests.client import dev_token
from tests.conftest import TEST_SETTINGS, RunningServer, run_server
from tests.sdk_support import (
    Recorder,
    ScriptedServer,
    TcpProxy,
    ack,
    publish_games,
    read_subscribe,
)
from tests.tokens import BOT_SCOPE, JwksServer

G1 = ("chess", "g1")
S1 = "game:chess#g1"


class Tokens:
    """A ``get_token`` that records its calls and can hold a connect until allowed."""

    def __init__(self, user: str = "alice", tokens: list[str] | None = None) -> None:
        self.user = user
        self.tokens = tokens or []
        self.calls: list[bool] = []
        self.times: list[float] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, refresh: bool) -> str:
        self.calls.append(refresh)
        self.times.append(asyncio.get_running_loop().time())
        await self.gate.wait()
        if self.tokens:
            return self.tokens.pop(0)
        return dev_token(self.user)


def sdk(url: str | list[str], tokens: Tokens | None = None, **options: Any) -> RealtimeClient:
    return RealtimeClient(url, get_token=tokens or Tokens(), rand=lambda: 0.0, **options)


def session_of(server: RunningServer, user: str = "alice") -> Any:
    (session,) = server.node.index.by_user[user]
    return session


async def connected(client: RealtimeClient, within: float = 15.0) -> None:
    async with asyncio.timeout(within):
        await client.wait_connected()


# --- delivery and positions ------------------------------------------------------


async def test_handlers_get_each_event_once_and_positions_wait_for_them(
    server: RunningServer,
) -> None:
    gate = asyncio.Event()
    inside: list[int | None] = []

    async def slow(event: Event) -> None:
        inside.append(event.offset)
        await gate.wait()

    client = sdk(server.ws_url, games=[G1])
    rec = Recorder().attach(client)
    client.on("game", slow)
    async with client:
        await connected(client)
        assert client.state == "connected"
        assert [(r.stream, r.was_recovering, r.recovered) for r in rec.recovered] == [
            ("user:alice", False, False),
            (S1, False, False),
        ]
        await publish_games(server, G1, range(3))
        await rec.until(lambda: inside == [1], "the first event in its handler")
        # the handler has not returned: the position stays where it was
        assert client.positions[S1].offset == 0
        gate.set()
        await rec.until(lambda: client.positions[S1].offset == 3, "the commit")
        assert rec.payloads() == [0, 1, 2] and inside == [1, 2, 3]
    assert rec.states == ["connecting", "connected", "disconnected"]
    assert rec.disconnects == [Disconnected(1000, "closed by the application", False)]


async def test_a_restart_1012_comes_back_at_once_and_replays_the_gap(
    server: RunningServer,
) -> None:
    tokens = Tokens()
    client = sdk(server.ws_url, tokens, games=[G1])
    rec = Recorder().attach(client)
    async with client:
        await connected(client)
        await publish_games(server, G1, range(2))
        await rec.until(lambda: rec.payloads() == [0, 1], "the live events")
        tokens.gate.clear()  # hold the reconnect until the gap is published
        session_of(server).close(CloseCode.SERVICE_RESTART, "server restarting")
        await rec.until(lambda: len(rec.disconnects) == 1, "the 1012")
        assert rec.disconnects[0] == Disconnected(1012, "server restarting", True, 0.0)
        await publish_games(server, G1, range(2, 5))
        tokens.gate.set()
        await rec.until(lambda: rec.connects == 2, "the reconnect")
        await rec.until(lambda: rec.payloads() == [0, 1, 2, 3, 4], "the replay")
        game = [r for r in rec.recovered if r.stream == S1]
        assert (game[-1].was_recovering, game[-1].recovered, game[-1].replayed) == (True, True, 3)
        assert [e.replayed for e in rec.events] == [False, False, True, True, True]
        assert rec.resyncs == []
        assert client.positions[S1].offset == 5
        await publish_games(server, G1, range(5, 6))
        await rec.until(lambda: rec.payloads()[-1:] == [5], "a live event after the replay")
        assert rec.payloads() == list(range(6))


async def test_a_replayed_burst_reaches_a_coalescing_handler_as_one_call(
    server: RunningServer,
) -> None:
    tokens = Tokens()
    client = sdk(server.ws_url, tokens, games=[G1], coalesce=["game"])
    rec = Recorder().attach(client)
    async with client:
        await connected(client)
        tokens.gate.clear()
        session_of(server).close(CloseCode.SERVICE_RESTART, "server restarting")
        await rec.until(lambda: len(rec.disconnects) == 1, "the 1012")
        await publish_games(server, G1, range(50))
        tokens.gate.set()
        await rec.until(lambda: len(rec.payloads()) == 50, "the replay")
        (call,) = rec.events
        assert call.replayed and call.offset == 50 and len(call.batch) == 50
        assert rec.payloads() == list(range(50))  # nothing dropped, in order
        await publish_games(server, G1, range(50, 52))
        await rec.until(lambda: len(rec.events) == 3, "live events, one call each")


async def test_positions_in_a_file_recover_across_processes(
    server: RunningServer, tmp_path: Path
) -> None:
    path = tmp_path / "positions.json"
    first = sdk(server.ws_url, games=[G1], storage=path)
    rec = Recorder().attach(first)
    async with first:
        await connected(first)
        await publish_games(server, G1, range(2))
        await rec.until(lambda: FileStorage(path).load().get(S1) is not None, "a stored position")
        await rec.until(lambda: FileStorage(path).load()[S1].offset == 2, "the stored commit")
    await publish_games(server, G1, range(2, 5))
    second = sdk(server.ws_url, games=[G1], storage=str(path))
    again = Recorder().attach(second)
    async with second:
        await connected(second)
        await again.until(lambda: again.payloads() == [2, 3, 4], "the replay")
        game = [r for r in again.recovered if r.stream == S1]
        assert (game[0].was_recovering, game[0].recovered, game[0].replayed) == (True, True, 3)


# --- the close-code policy -----------------------------------------------------


@pytest.mark.parametrize("server", [{"max_connections_per_user": 1}], indirect=True)
async def test_4509_stops_the_client(server: RunningServer) -> None:
    await server.subscribed("alice")
    tokens = Tokens()
    client = sdk(server.ws_url, tokens)
    rec = Recorder().attach(client)
    async with client:
        pending = client.set_games([G1])
        with pytest.raises(ClientStopped) as caught:
            async for _event in client:
                pass
        assert caught.value.info == Disconnected(4509, "too many connections", False)
        assert client.state == "disconnected"
        assert rec.errors[0].code == "too_many_connections"
        with pytest.raises(ClientStopped):
            await pending
        with pytest.raises(ClientStopped):
            await client.wait_connected()
    assert tokens.calls == [False]  # one attempt, no retry


async def test_1008_refreshes_the_token_once_then_stops(server: RunningServer) -> None:
    tokens = Tokens(tokens=["not-a-token", "still-not-a-token", "never-asked"])
    client = sdk(server.ws_url, tokens)
    rec = Recorder().attach(client)
    async with client:
        turns = client.turns()
        with pytest.raises(ClientStopped) as caught:
            async for _turn in turns:
                pass
        assert caught.value.info.code == 1008 and not caught.value.info.will_reconnect
    assert tokens.calls == [False, True]  # the one refresh, then stop
    assert [(d.code, d.will_reconnect) for d in rec.disconnects] == [(1008, True), (1008, False)]
    assert client.state == "disconnected"


async def test_a_refreshed_token_is_used_and_each_new_run_of_1008_gets_one(
    server: RunningServer,
) -> None:
    tokens = Tokens(tokens=[dev_token("alice", expires_in=-3600)])
    client = sdk(server.ws_url, tokens)
    rec = Recorder().attach(client)
    async with client:
        await connected(client)
        assert tokens.calls == [False, True]
        session_of(server).close(CloseCode.POLICY_VIOLATION, "invalid token")
        await rec.until(lambda: rec.connects == 2, "the reconnect with a fresh token")
        assert tokens.calls == [False, True, True]
        assert client.state == "connected"


async def test_1013_backs_off_with_the_longer_floor(jwks_bot: BotWorld) -> None:
    await jwks_bot.jwks.stop()  # the bot pool's keys cannot be fetched: unavailable, 1013
    tokens = BotTokens(jwks_bot)
    client = sdk(jwks_bot.server.ws_url, tokens)
    rec = Recorder().attach(client)
    async with client:
        await rec.until(lambda: len(rec.disconnects) >= 2, "two tries", within=30)
        first, second = rec.disconnects[:2]
        assert (first.code, first.will_reconnect) == (1013, True)
        assert first.retry_in is not None and first.retry_in >= OVERLOAD_MIN
        assert second.code == 1013 and client.state == "connecting"
        assert tokens.times[1] - tokens.times[0] >= OVERLOAD_MIN
        assert rec.errors[0].code == "unavailable"


@pytest.mark.parametrize("server", [{"max_connections": 1}], indirect=True)
async def test_a_503_at_upgrade_backs_off_with_the_longer_floor(server: RunningServer) -> None:
    holder = await server.subscribed("bob")
    metrics = server.node.metrics

    def refused_and_accepted() -> tuple[float, float]:
        return (
            metrics.value("ap_refused_upgrades_total"),
            metrics.value("ap_accepted_upgrades_total"),
        )

    refused, accepted = refused_and_accepted()
    client = sdk(server.ws_url)
    rec = Recorder().attach(client)
    async with client:
        await rec.until(lambda: len(rec.disconnects) == 1, "the refused upgrade")
        assert rec.disconnects[0] == Disconnected(1006, "HTTP 503", True, OVERLOAD_MIN)
        assert client.state == "connecting"
        assert refused_and_accepted() == (refused + 1, accepted)
        await holder.close()
        await rec.until(lambda: rec.connects == 1, "the connect once the node has room", 30)
        assert refused_and_accepted()[1] == accepted + 1


async def test_4008_reconnects_recovers_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = dataclasses.replace(
        TEST_SETTINGS, outbox_limit_bytes=64 * 1024, socket_send_buffer_bytes=4096
    )
    async with run_server(settings) as server:
        client = sdk(server.ws_url, games=[G1])
        rec = Recorder().attach(client)
        async with client:
            await connected(client)
            ws = client._ws
            assert ws is not None
            ws.transport.pause_reading()  # a reader stalled (a busy process, a slow link)
            published = 0
            big = "x" * 16_000
            while not any(s.close_task for s in server.node.index.by_user.get("alice", ())):
                assert published < 45, "the node never closed the stalled reader"
                status, _ = await server.publish(
                    {
                        "verb": "game",
                        "payload": {"meta": "chess", "id": "g1", "n": published, "big": big},
                    }
                )
                assert status == 202
                published += 1
            ws.transport.resume_reading()
            await rec.until(lambda: len(rec.disconnects) == 1, "the 4008")
            assert (rec.disconnects[0].code, rec.disconnects[0].will_reconnect) == (4008, True)
            await publish_games(server, G1, range(published, published + 2))
            await rec.until(lambda: rec.connects == 2, "the reconnect")
            await rec.until(
                lambda: rec.payloads()[-1:] == [published + 1], "every event, then a live one"
            )
            assert rec.payloads() == list(range(published + 2))  # each once, none lost
            assert rec.resyncs == []
    assert any("slow consumer (4008)" in r.message for r in caplog.records)


@pytest.mark.parametrize("server", [{"subscribe_timeout": 0.3}], indirect=True)
async def test_4408_reconnects_and_is_logged_as_a_client_bug(
    server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await TcpProxy(int(server.ws_url.rsplit(":", 1)[1].strip("/"))).start()
    try:
        proxy.hold(1.5)  # the first subscribe reaches the node after its deadline
        client = sdk(proxy.url)
        rec = Recorder().attach(client)
        async with client:
            await connected(client)
            assert [d.code for d in rec.disconnects] == [4408]
            assert rec.disconnects[0].will_reconnect
            assert proxy.connections == 2
    finally:
        await proxy.close()
    bugs = [r for r in caplog.records if r.levelno == logging.ERROR and "client bug" in r.message]
    assert bugs and "4408" in bugs[0].message


async def test_1001_reconnects() -> None:
    async def script(number: int, ws: Any) -> None:
        subscribe = await read_subscribe(scripted, ws)
        await ack(ws, subscribe)
        if number == 0:
            await ws.close(1001, "idle")
        else:
            await ws.wait_closed()

    scripted = await ScriptedServer(script).start()
    try:
        client = sdk(scripted.url)
        rec = Recorder().attach(client)
        async with client:
            await rec.until(lambda: rec.connects == 2, "the reconnect after 1001")
            assert rec.disconnects == [Disconnected(1001, "idle", True, 0.5)]
            assert [s["action"] for s in scripted.subscribes] == ["subscribe", "subscribe"]
            assert all("since" in s and s["heartbeat"] is True for s in scripted.subscribes)
    finally:
        await scripted.close()


# --- liveness ---------------------------------------------------------------------


@pytest.mark.parametrize("server", [{"heartbeat_seconds": 1}], indirect=True)
async def test_a_silent_socket_is_replaced_and_what_it_missed_recovered(
    server: RunningServer,
) -> None:
    proxy = await TcpProxy(int(server.ws_url.rsplit(":", 1)[1].strip("/"))).start()
    try:
        client = sdk(proxy.url, games=[G1])
        rec = Recorder().attach(client)
        async with client:
            await connected(client)
            loop = asyncio.get_running_loop()
            proxy.silence()  # open, and silent: no frame, no FIN
            silenced_at = loop.time()
            await publish_games(server, G1, range(3))
            await rec.until(lambda: len(rec.disconnects) == 1, "the watchdog")
            # 3 heartbeats of 1 s: never before, and a replacement socket follows
            assert loop.time() - silenced_at >= 1.9  # the last heartbeat was at most 1 s before
            assert rec.disconnects[0].reason == "read timeout"
            await rec.until(lambda: rec.payloads() == [0, 1, 2], "the recovery")
            assert rec.connects == 2 and proxy.connections == 2
    finally:
        await proxy.close()


async def test_an_unacknowledged_subscribe_is_given_up() -> None:
    async def script(number: int, ws: Any) -> None:
        subscribe = await read_subscribe(scripted, ws)
        if number > 0:
            await ack(ws, subscribe)
        await ws.wait_closed()

    scripted = await ScriptedServer(script).start()
    try:
        client = sdk(scripted.url, ack_timeout=0.5)
        rec = Recorder().attach(client)
        async with client:
            await connected(client)
            assert [d.reason for d in rec.disconnects] == ["subscribe not acknowledged"]
    finally:
        await scripted.close()


async def test_a_connect_that_hangs_times_out_as_overload() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts, answers nothing

    mute_server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = mute_server.sockets[0].getsockname()[1]
    try:
        client = sdk(f"ws://127.0.0.1:{port}/", connect_timeout=0.3)
        rec = Recorder().attach(client)
        async with client:
            await rec.until(lambda: len(rec.disconnects) == 1, "the connect timeout")
            assert rec.disconnects[0] == Disconnected(1006, "connect timeout", True, OVERLOAD_MIN)
    finally:
        mute_server.close()


async def test_reconnect_now_replaces_the_socket_at_once(server: RunningServer) -> None:
    client = sdk(server.ws_url)
    rec = Recorder().attach(client)
    async with client:
        await connected(client)
        first = session_of(server)
        client.reconnect_now()
        await rec.until(lambda: rec.connects == 2, "the new socket")
        assert rec.disconnects == [Disconnected(1006, "reconnect requested", True, 0.0)]
        await rec.until(lambda: session_of(server) is not first, "the old session gone")
    assert rec.states == ["connecting", "connected", "connecting", "connected", "disconnected"]


async def test_the_next_address_is_tried_after_a_failure(server: RunningServer) -> None:
    dead = "ws://127.0.0.1:9/"  # nothing listens on the discard port
    client = sdk([dead, server.ws_url])
    rec = Recorder().attach(client)
    async with client:
        await connected(client)
        assert rec.disconnects[0].code == 1006 and rec.disconnects[0].retry_in == 0.5


# --- setGames ------------------------------------------------------------------


async def test_set_games_is_sent_once_acked_and_carried_by_every_subscribe(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = server.node
    watches: list[frozenset[str]] = []
    original = node.watch

    async def counting(session: Any, games: frozenset[str], since: Any = None) -> bool:
        watches.append(games)
        return await original(session, games, since)

    monkeypatch.setattr(node, "watch", counting)
    tokens = Tokens()
    client = sdk(server.ws_url, tokens)
    rec = Recorder().attach(client)
    async with client:
        await connected(client)
        await asyncio.wait_for(client.set_games([G1, ("go", "x")]), 10)
        assert session_of(server).watching == {"chess#g1", "go#x"}
        assert watches == [frozenset({"chess#g1", "go#x"})]
        await asyncio.wait_for(client.set_games([("go", "x"), G1]), 10)  # the same set
        assert len(watches) == 1  # nothing sent
        session_of(server).close(CloseCode.SERVICE_RESTART, "server restarting")
        await rec.until(lambda: rec.connects == 2, "the reconnect")
        assert session_of(server).watching == {"chess#g1", "go#x"}  # in the subscribe
        assert len(watches) == 1  # and no watchGames, blind or not
        await publish_games(server, G1, range(1))
        await rec.until(lambda: rec.payloads() == [0], "an event of a watched game")
        # while away: sent with the next subscribe, settled by its ack
        tokens.gate.clear()
        session_of(server).close(CloseCode.SERVICE_RESTART, "server restarting")
        await rec.until(lambda: len(rec.disconnects) == 2, "the second 1012")
        waiting = client.set_games([("go", "y")])
        assert not waiting.done()
        tokens.gate.set()
        await asyncio.wait_for(waiting, 10)
        assert session_of(server).watching == {"go#y"} and len(watches) == 1


@pytest.mark.parametrize("server", [{"max_watched_games_per_user": 2}], indirect=True)
async def test_a_refused_set_games_keeps_the_old_set_on_both_sides(server: RunningServer) -> None:
    client = sdk(server.ws_url, games=[G1])
    rec = Recorder().attach(client)
    async with client:
        await connected(client)
        with pytest.raises(GamesRefused) as caught:
            await asyncio.wait_for(client.set_games([("a", "1"), ("a", "2"), ("a", "3")]), 10)
        assert caught.value.code == "too_many_games"
        assert client.games == [G1] and session_of(server).watching == {"chess#g1"}
        assert rec.errors[0].ack_id is not None
        await asyncio.wait_for(client.set_games([("a", "1")]), 10)
        assert session_of(server).watching == {"a#1"}


async def test_presence_is_kept_and_handed_over(server: RunningServer) -> None:
    changes: list[PresenceChange] = []
    client = sdk(server.ws_url)
    client.on("connections", changes.append)
    async with client:
        await connected(client)
        await server.subscribed("bob")
        await Recorder().until(
            lambda: (
                client.presence is not None and client.presence.visible_user_ids == {"alice", "bob"}
            ),
            "both users visible",
        )
        assert changes and changes[-1].presence == client.presence


# --- bots: tokens and turns ---------------------------------------------------------

BOT = "sdk-bot"
SECRET = "sdk-bot-secret"


@dataclasses.dataclass
class BotWorld:
    server: RunningServer
    store: MemoryStore
    jwks: JwksServer

    def credentials(self) -> Any:
        from apclient import ClientCredentials

        return ClientCredentials(self.jwks.token_url, BOT, SECRET, BOT_SCOPE)

    async def your_turn(self, game_id: str, **ply: int) -> None:
        payload = {"meta": "chess", "id": game_id, **ply}
        body = {"verb": "yourTurn", "users": [BOT], "payload": payload}
        status, reply = await self.server.publish(body)
        assert status == 202, reply


class BotTokens(Tokens):
    def __init__(self, world: BotWorld) -> None:
        super().__init__()
        self.world = world

    async def __call__(self, refresh: bool) -> str:
        await super().__call__(refresh)
        return self.world.jwks.pools["/bots/.well-known/jwks.json"].bot_token(BOT)


@pytest.fixture
async def jwks_bot() -> AsyncIterator[BotWorld]:
    jwks = JwksServer()
    await jwks.start()
    bots = jwks.pool("bots")
    jwks.add_client(bots, BOT, SECRET)
    store = MemoryStore()
    store.put_bot(BotRecord(client_id=BOT, name="Sdk", owner="owner-1"))
    store.put_current_game(BOT, CurrentGame("g1", "chess", (BOT, "alice"), "0"))
    store.put_current_game(BOT, CurrentGame("g2", "chess", (BOT, "alice"), "1"))
    settings = dataclasses.replace(
        TEST_SETTINGS, bot_cognito_issuer=bots.issuer, bot_scope=BOT_SCOPE
    )
    try:
        async with run_server(settings, store) as server:
            yield BotWorld(server, store, jwks)
    finally:
        await jwks.stop()


async def test_turns_come_once_per_ply(jwks_bot: BotWorld) -> None:
    world = jwks_bot
    credentials = world.credentials()
    client = RealtimeClient(world.server.ws_url, get_token=credentials, rand=lambda: 0.0)
    got: list[tuple[str, str]] = []

    async def collect() -> None:
        async for turn in client.turns():
            got.append((turn.id, turn.source))

    async with client:
        reader = asyncio.create_task(collect())
        rec = Recorder().attach(client)
        await rec.until(lambda: got == [("g1", "pendingTurns")], "the pending turn")
        await world.your_turn("g1")  # the same ply, announced again
        await world.your_turn("g3")
        await rec.until(lambda: len(got) == 2, "the new game's turn")
        assert got[1] == ("g3", "yourTurn")
        # a reconnect lists g1 again: still the same ply, not a new turn
        session_of(world.server, BOT).close(CloseCode.SERVICE_RESTART, "server restarting")
        await rec.until(lambda: rec.connects == 2, "the reconnect")
        await rec.until(
            lambda: [e.verb for e in rec.events].count("pendingTurns") == 2, "pendingTurns again"
        )
        await world.your_turn("g4")
        await rec.until(lambda: len(got) == 3, "the next turn")
        assert got[2] == ("g4", "yourTurn")
        # the bot moves in g1 (it sees its own move as a skip), then must move again
        status, _ = await world.server.publish(
            {"verb": "game", "payload": {"meta": "chess", "id": "g1"}, "exclude": [BOT]}
        )
        assert status == 202
        await rec.until(lambda: client.positions.get("game:chess#g1") is not None, "the skip")
        await world.your_turn("g1")
        await rec.until(lambda: len(got) == 4, "the next ply of g1")
        assert got[3] == ("g1", "yourTurn")
        assert credentials.fetched == 1  # one token for every connect
    reader.cancel()


async def test_turns_that_name_their_ply_come_exactly_once_per_ply(jwks_bot: BotWorld) -> None:
    world = jwks_bot
    # a current game where alice is to move: watched (its stream heard), not pending
    world.store.put_current_game(BOT, CurrentGame("g3", "chess", (BOT, "alice"), "1"))
    client = RealtimeClient(world.server.ws_url, get_token=world.credentials(), rand=lambda: 0.0)
    got: list[tuple[str, int | None]] = []

    def turn(t: Any) -> None:
        got.append((t.id, t.ply.moves if t.ply else None))

    client.on("turn", turn)
    rec = Recorder().attach(client)
    async with client:
        await rec.until(lambda: got == [("g1", None)], "the pending turn")
        await world.your_turn("g3", numMoves=7, lastMoveTime=1_700_000_000_000)
        await rec.until(lambda: got[-1] == ("g3", 7), "g3's turn")
        # a comment in g3 (a frame on its stream), then the backend re-sends the turn
        # (ping_bot): the same ply, so no turn, although the game changed meanwhile
        status, _ = await world.server.publish(
            {"verb": "chat", "payload": {"meta": "chess", "id": "g3"}}
        )
        assert status == 202
        await rec.until(lambda: "game:chess#g3" in client.positions, "the comment")
        await world.your_turn("g3", numMoves=7)
        # an older ply that arrives late: no turn either
        await world.your_turn("g3", numMoves=5)
        # a marker: the next turn of another game, after which the repeats were read
        await world.your_turn("g4", numMoves=2)
        await rec.until(lambda: got[-1] == ("g4", 2), "the marker")
        assert got == [("g1", None), ("g3", 7), ("g4", 2)]
        await world.your_turn("g3", numMoves=9)  # the next ply, nothing else in between
        await rec.until(lambda: got[-1] == ("g3", 9), "g3's next ply")
        assert [e.verb for e in rec.events].count("yourTurn") == 5  # every event still arrives
    assert got == [("g1", None), ("g3", 7), ("g4", 2), ("g3", 9)]


async def test_a_slow_turn_never_holds_up_another_game(jwks_bot: BotWorld) -> None:
    world = jwks_bot
    release = asyncio.Event()
    handled: list[str] = []

    async def play(turn: Any) -> None:
        if turn.id == "g5":
            await release.wait()  # thinking for a long time
        handled.append(turn.id)

    client = RealtimeClient(world.server.ws_url, get_token=world.credentials(), rand=lambda: 0.0)
    client.on("turn", play)
    user = f"user:{BOT}"
    async with client:
        await connected(client)
        await Recorder().until(lambda: handled == ["g1"], "the pending turn")
        await world.your_turn("g5")  # offset 1: slow
        await world.your_turn("g6")  # offset 2: another game, not held up
        await Recorder().until(lambda: handled == ["g1", "g6"], "the other game's turn")
        # g6 is done but g5 is not: the user stream's position waits for it
        assert client.positions[user].offset == 0
        release.set()
        await Recorder().until(lambda: handled == ["g1", "g6", "g5"], "the slow one")
        await Recorder().until(lambda: client.positions[user].offset == 2, "the commits")


async def test_msgpack_frames_and_the_invisible_flag(server: RunningServer) -> None:
    client = sdk(server.ws_url, games=[G1], binary=True, invisible=True)
    rec = Recorder().attach(client)
    async with client:
        await connected(client)
        session = session_of(server)
        assert session.binary and session.invisible
        await publish_games(server, G1, range(2))
        await rec.until(lambda: rec.payloads() == [0, 1], "events over msgpack")
