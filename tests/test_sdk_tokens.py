"""The SDK's client-credentials token against a token URL over real HTTP: cached until
shortly before it expires, one fetch at a time, refused credentials stop the client
and an outage is retried."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from apclient import (
    ClientCredentials,
    ClientStopped,
    RealtimeClient,
    TokenUnavailable,
    Unauthorized,
)
from apclient.tokens import token_claims
from server.store import BotRecord, MemoryStore
from tests.clock import Clock
from tests.conftest import TEST_SETTINGS, RunningServer, run_server
from tests.sdk_support import Recorder
from tests.tokens import BOT_SCOPE, JwksServer

BOT = "token-bot"
SECRET = "token-bot-secret"


@pytest.fixture
async def issuer() -> AsyncIterator[JwksServer]:
    server = JwksServer()
    await server.start()
    server.add_client(server.pool("bots"), BOT, SECRET)
    try:
        yield server
    finally:
        await server.stop()


def credentials(issuer: JwksServer, **options: Any) -> ClientCredentials:
    return ClientCredentials(issuer.token_url, BOT, SECRET, BOT_SCOPE, **options)


async def test_a_token_is_fetched_once_and_reused(issuer: JwksServer) -> None:
    get = credentials(issuer)
    token = await get()
    assert token_claims(token)["sub"] == BOT
    assert await get() == token and await get(False) == token
    assert issuer.tokens_issued == 1 and get.fetched == 1


async def test_concurrent_callers_share_one_fetch(issuer: JwksServer) -> None:
    get = credentials(issuer)
    tokens = await asyncio.gather(*(get() for _ in range(8)))
    assert len(set(tokens)) == 1 and issuer.token_requests == 1
    # a refresh asked by many at once is still one request
    await asyncio.gather(*(get(True) for _ in range(8)))
    assert issuer.token_requests == 2


async def test_a_refused_token_is_replaced_on_refresh(issuer: JwksServer) -> None:
    get = credentials(issuer)
    await get()
    await get(True)
    assert issuer.tokens_issued == 2
    get.invalidate()
    await get()
    assert issuer.tokens_issued == 3


async def test_the_token_is_renewed_before_it_expires(issuer: JwksServer) -> None:
    clock = Clock(1_000_000.0)
    get = credentials(issuer, clock=clock, margin=60.0)
    await get()
    clock.now += 3600 - 61
    await get()
    assert issuer.tokens_issued == 1
    clock.now += 2  # inside the last minute
    await get()
    assert issuer.tokens_issued == 2


async def test_a_short_lived_token_is_not_fetched_on_every_call(issuer: JwksServer) -> None:
    issuer.token_lifetime = 20
    clock = Clock(1_000_000.0)
    get = credentials(issuer, clock=clock, margin=60.0)
    await get()
    clock.now += 9  # before half its life: reused
    await get()
    assert issuer.tokens_issued == 1


async def test_wrong_credentials_are_unauthorized_and_an_outage_is_temporary(
    issuer: JwksServer,
) -> None:
    with pytest.raises(Unauthorized):
        await ClientCredentials(issuer.token_url, BOT, "wrong", BOT_SCOPE)()
    with pytest.raises(Unauthorized):
        await ClientCredentials(issuer.token_url, BOT, SECRET, "other/scope")()
    issuer.token_down = True
    with pytest.raises(TokenUnavailable):
        await credentials(issuer)()
    closed = f"http://127.0.0.1:{issuer.port}/oauth2/token"
    await issuer.stop()
    with pytest.raises(TokenUnavailable):
        await ClientCredentials(closed, BOT, SECRET, BOT_SCOPE, timeout=2)()


@dataclasses.dataclass
class World:
    server: RunningServer
    issuer: JwksServer


@pytest.fixture
async def world(issuer: JwksServer) -> AsyncIterator[World]:
    store = MemoryStore()
    store.put_bot(BotRecord(client_id=BOT, name="Tokens", owner="owner-1"))
    bots = issuer.pools["/bots/.well-known/jwks.json"]
    settings = dataclasses.replace(
        TEST_SETTINGS, bot_cognito_issuer=bots.issuer, bot_scope=BOT_SCOPE
    )
    async with run_server(settings, store) as server:
        yield World(server, issuer)


async def test_refused_credentials_stop_the_client(world: World) -> None:
    get = ClientCredentials(world.issuer.token_url, BOT, "wrong", BOT_SCOPE)
    client = RealtimeClient(world.server.ws_url, get_token=get, rand=lambda: 0.0)
    rec = Recorder().attach(client)
    async with client:
        with pytest.raises(ClientStopped) as caught:
            await asyncio.wait_for(client.wait_connected(), 10)
        assert caught.value.info.code == 1008 and not caught.value.info.will_reconnect
        assert "unauthorized" in caught.value.info.reason
    assert client.state == "disconnected"
    assert world.issuer.token_requests == 1  # no retry loop against the token URL
    assert rec.disconnects[-1].will_reconnect is False


async def test_a_token_url_outage_is_retried(world: World) -> None:
    world.issuer.token_down = True
    get = ClientCredentials(world.issuer.token_url, BOT, SECRET, BOT_SCOPE)
    client = RealtimeClient(world.server.ws_url, get_token=get, rand=lambda: 0.0)
    async with client:
        await Recorder().until(lambda: world.issuer.token_requests >= 2, "a retry")
        assert client.state == "connecting"
        world.issuer.token_down = False
        await asyncio.wait_for(client.wait_connected(), 15)
    assert get.fetched == 1
