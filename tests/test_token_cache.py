"""The verified-token cache: bounded, keyed by hash, never past exp; and its use in auth."""

from __future__ import annotations

import time

import jwt
import pytest

from server.auth.token_cache import TokenCache
from server.auth.verify import Authenticator, AuthError, DevVerifier, Identity
from tests.client import DEV_SECRET, dev_token
from tests.clock import Clock


def test_an_entry_is_never_used_at_or_after_exp() -> None:
    clock = Clock()
    cache: TokenCache[str] = TokenCache(10, clock)
    cache.put("t", "alice", expires_at=1010.0)
    assert cache.get("t") == "alice"
    clock.now = 1010.0
    assert cache.get("t") is None
    assert len(cache) == 0


def test_the_least_recently_used_entry_goes_first() -> None:
    cache: TokenCache[str] = TokenCache(2, Clock())
    cache.put("a", "A", 2000.0)
    cache.put("b", "B", 2000.0)
    assert cache.get("a") == "A"  # now b is the oldest
    cache.put("c", "C", 2000.0)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == ("A", None, "C")


def test_size_zero_disables_and_the_token_itself_is_not_kept() -> None:
    off: TokenCache[str] = TokenCache(0, Clock())
    off.put("t", "x", 2000.0)
    assert off.get("t") is None
    on: TokenCache[str] = TokenCache(5, Clock())
    on.put("secret-token", "x", 2000.0)
    assert all(b"secret-token" not in key for key in on._entries)


async def test_the_authenticator_verifies_a_token_once() -> None:
    auth = Authenticator(cognito=None, dev=DevVerifier(DEV_SECRET), cache_size=10)
    calls = 0
    verify = auth._verify

    async def counting(token: str) -> Identity:
        nonlocal calls
        calls += 1
        return await verify(token)

    auth._verify = counting  # type: ignore[method-assign]
    token = dev_token("alice")
    assert (await auth.verify(token)).user_id == "alice"
    assert (await auth.verify(token)).user_id == "alice"
    assert calls == 1
    with pytest.raises(AuthError):
        await auth.verify(token + "x")  # a different token is checked, and refused
    assert calls == 2


async def test_an_expired_token_is_verified_again_and_refused() -> None:
    auth = Authenticator(cognito=None, dev=DevVerifier(DEV_SECRET), cache_size=10)
    now = int(time.time())
    # An hour of life, however slowly this runs; then the cache's clock moves past it.
    token = jwt.encode({"sub": "u", "iat": now, "exp": now + 3600}, DEV_SECRET, "HS256")
    await auth.verify(token)
    assert len(auth.cache) == 1
    auth.cache._clock = lambda: now + 3601.0
    # past exp the cache no longer answers; verification (with its clock-skew
    # leeway) decides, and a token far past exp is refused
    assert auth.cache.get(token) is None
    late = jwt.encode({"sub": "u", "iat": now, "exp": now - 600}, DEV_SECRET, "HS256")
    with pytest.raises(AuthError, match="expired"):
        await auth.verify(late)
