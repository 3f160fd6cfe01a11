"""Tokens: a bot's client-credentials grant, fetched once and cached until shortly
before it expires, one fetch at a time.

The pool's token URL (Cognito's ``/oauth2/token``) takes

    POST grant_type=client_credentials&scope=<scope>
    Authorization: Basic base64(client_id:client_secret)

and answers ``{"access_token", "expires_in", "token_type"}``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import jwt

log = logging.getLogger("apclient")


class Unauthorized(Exception):
    """The credentials or the token were refused: retrying cannot help, the client stops.

    A ``get_token`` of your own raises it (or returns None) to stop the client."""


class TokenUnavailable(Exception):
    """The token could not be fetched right now (network, 5xx, 429): retried with backoff."""


REFUSED_STATUSES = frozenset({400, 401, 403})
"""What the token endpoint answers to bad credentials, an unknown client or a wrong scope."""


class ClientCredentials:
    """A ``get_token`` for bots: ``RealtimeClient(url, get_token=ClientCredentials(...))``.

    The token is reused until ``margin`` seconds before its expiry (the sooner
    of ``expires_in`` and the token's own ``exp``), or until the client asks
    for a fresh one after the server refused it (``refresh=True``). Concurrent
    callers share one request.
    """

    def __init__(
        self,
        token_url: str,
        client_id: str,
        client_secret: str,
        scope: str,
        *,
        margin: float = 60.0,
        timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.token_url = token_url
        self.client_id = client_id
        self._basic = base64.b64encode(f"{client_id}:{client_secret}".encode()).decode()
        self.scope = scope
        self.margin = margin
        self.timeout = timeout
        self._clock = clock
        self._token: str | None = None
        self._renew_at = 0.0
        self._fetches = 0  # how many fetches completed: a waiter sees if one landed meanwhile
        self._lock = asyncio.Lock()
        self.fetched = 0  # tokens obtained, for the curious and for tests

    async def __call__(self, refresh: bool = False) -> str:
        seen = self._fetches
        async with self._lock:
            fresh = self._fetches != seen  # fetched while this call waited: use it
            if self._token is not None and (fresh or (not refresh and self._valid())):
                return self._token
            return await self._fetch()

    def invalidate(self) -> None:
        """Forget the cached token: the next call fetches a new one."""
        self._token = None

    def _valid(self) -> bool:
        return self._clock() < self._renew_at

    async def _fetch(self) -> str:
        form = {"grant_type": "client_credentials", "scope": self.scope}
        headers = {"Authorization": f"Basic {self._basic}"}
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(self.token_url, data=form, headers=headers) as response,
            ):
                status = response.status
                body = await response.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TokenUnavailable(f"token endpoint unreachable: {exc!r}") from None
        if status in REFUSED_STATUSES:
            raise Unauthorized(f"token endpoint refused the credentials: {status} {body[:200]}")
        if status != 200:
            raise TokenUnavailable(f"token endpoint answered {status}: {body[:200]}")
        token, lifetime = _read_answer(body)
        now = self._clock()
        expires_at = now + lifetime
        with_exp = _exp_of(token)
        if with_exp is not None:
            expires_at = min(expires_at, with_exp)
        # Renew ahead of expiry, but never so early that a short-lived token is
        # fetched again on every connect.
        self._renew_at = expires_at - min(self.margin, max(0.0, expires_at - now) / 2)
        self._token = token
        self._fetches += 1
        self.fetched += 1
        return token


def _read_answer(body: str) -> tuple[str, float]:
    try:
        answer: Any = json.loads(body)
        token = answer["access_token"]
        lifetime = float(answer.get("expires_in", 3600))
    except (ValueError, KeyError, TypeError):
        raise TokenUnavailable(f"token endpoint answered without a token: {body[:200]}") from None
    if not isinstance(token, str) or not token:
        raise TokenUnavailable("token endpoint answered an empty token")
    return token, lifetime


def _exp_of(token: str) -> float | None:
    claims = token_claims(token)
    exp = claims.get("exp")
    return float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None


def token_claims(token: str) -> dict[str, Any]:
    """A JWT's claims, unverified (the server verifies): ``sub`` names the user stream."""
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return {}
    return claims if isinstance(claims, dict) else {}
