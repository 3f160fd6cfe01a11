"""JWKS over real HTTP: caching, key rotation, the refetch cooldown, and an outage.

The keys come from a local aiohttp server; the verifier fetches them with its
own HTTP client, exactly as it fetches a Cognito pool's JWKS in production.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from server.auth.jwks import HttpJwks, JwksUnavailable, UnknownKey
from server.auth.verify import AuthError, AuthUnavailable, BotVerifier, CognitoVerifier
from tests.clock import Clock
from tests.tokens import BOT_SCOPE, HUMAN_CLIENT_ID, JwksServer


@pytest.fixture
async def jwks_server() -> AsyncIterator[JwksServer]:
    server = JwksServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def clock() -> Clock:
    return Clock()


async def test_keys_are_fetched_once_and_cached(jwks_server: JwksServer, clock: Clock) -> None:
    pool = jwks_server.pool("bots")
    jwks = HttpJwks(pool.issuer + "/.well-known/jwks.json", clock=clock)
    verifier = BotVerifier(pool.issuer, BOT_SCOPE, jwks)
    try:
        for _ in range(5):
            identity = await verifier.verify(pool.bot_token("bot-1"), {"kid": "key-1"})
            assert (identity.user_id, identity.kind) == ("bot-1", "bot")
        assert jwks_server.count(pool) == 1
    finally:
        await jwks.close()


async def test_a_rotated_key_is_fetched_when_a_token_names_it(
    jwks_server: JwksServer, clock: Clock
) -> None:
    pool = jwks_server.pool("humans")
    jwks = HttpJwks(pool.issuer + "/.well-known/jwks.json", clock=clock, cooldown=30)
    verifier = CognitoVerifier(pool.issuer, HUMAN_CLIENT_ID, jwks)
    try:
        assert (await verifier.verify(pool.id_token("alice"), {"kid": "key-1"})).user_id == "alice"
        clock.now += 31  # rotations are rare; the last fetch is older than the cooldown
        pool.rotate("key-2", keep_old=False)
        token = pool.id_token("alice")
        assert (await verifier.verify(token, {"kid": "key-2"})).user_id == "alice"
        assert jwks_server.count(pool) == 2
        # The retired key is gone from the refetched set: its tokens are refused.
        old = pool.sign({"sub": "x"}, kid="key-1")
        with pytest.raises(AuthError, match="unknown key"):
            await verifier.verify(old, {"kid": "key-1"})
    finally:
        await jwks.close()


async def test_a_flood_of_unknown_key_ids_costs_one_fetch_per_cooldown(
    jwks_server: JwksServer, clock: Clock
) -> None:
    pool = jwks_server.pool("bots")
    jwks = HttpJwks(pool.issuer + "/.well-known/jwks.json", clock=clock, cooldown=30)
    try:
        await jwks.key("key-1")
        clock.now += 31
        for n in range(200):
            with pytest.raises(UnknownKey):
                await jwks.key(f"made-up-{n}")
        assert jwks_server.count(pool) == 2  # the first, and one refetch for the flood
        clock.now += 31
        with pytest.raises(UnknownKey):
            await jwks.key("made-up-again")
        assert jwks_server.count(pool) == 3
        # Known keys never wait for the cooldown.
        assert (await jwks.key("key-1")).key_id == "key-1"
    finally:
        await jwks.close()


async def test_cached_keys_survive_an_outage_and_the_error_is_clear(
    jwks_server: JwksServer, clock: Clock
) -> None:
    pool = jwks_server.pool("bots")
    url = pool.issuer + "/.well-known/jwks.json"
    jwks = HttpJwks(url, clock=clock, cooldown=30, max_age=60)
    verifier = BotVerifier(pool.issuer, BOT_SCOPE, jwks)
    try:
        await verifier.verify(pool.bot_token("bot-1"), {"kid": "key-1"})
        jwks_server.down = True  # the issuer answers 503
        clock.now += 120  # past max_age: a refresh is attempted, and fails
        assert (await verifier.verify(pool.bot_token("bot-1"), {"kid": "key-1"})).kind == "bot"
        assert jwks_server.count(pool) == 2
        with pytest.raises(AuthUnavailable) as caught:
            await verifier.verify(pool.bot_token("bot-1", kid="key-9"), {"kid": "key-9"})
        message = str(caught.value)
        assert url in message and "503" in message and "key-9" in message

        await jwks_server.stop()  # now the port is closed: connection refused
        clock.now += 31
        with pytest.raises(JwksUnavailable, match=r"ClientConnectorError|Connect"):
            await jwks.key("key-9")
        assert (await jwks.key("key-1")).key_id == "key-1"

        jwks_server.down = False
        await jwks_server.start()  # same port: the issuer is back
        pool.rotate("key-9")
        clock.now += 31
        assert (await jwks.key("key-9")).key_id == "key-9"
    finally:
        await jwks.close()


async def test_a_bad_document_keeps_the_cached_keys(jwks_server: JwksServer, clock: Clock) -> None:
    pool = jwks_server.pool("bots")
    jwks = HttpJwks(pool.issuer + "/.well-known/jwks.json", clock=clock, cooldown=1)
    try:
        await jwks.key("key-1")
        pool.keys.clear()  # the issuer now publishes {"keys": []}
        clock.now += 2
        with pytest.raises(JwksUnavailable, match="usable"):
            await jwks.key("key-2")
        assert (await jwks.key("key-1")).key_id == "key-1"
    finally:
        await jwks.close()
