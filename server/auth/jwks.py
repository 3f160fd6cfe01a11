"""Signing keys of a Cognito pool: a JWKS read once from a file, or fetched over HTTP.

The HTTP source never blocks the event loop (aiohttp), keeps the keys it has
and refetches only when a token names a key it does not know, or when its keys
are older than ``max_age``. Fetches are at least ``cooldown`` apart, so a flood
of tokens with made-up key ids costs the issuer one request per cooldown, not
one per token. When the issuer cannot be reached, keys already cached keep
working, and a token whose key is not cached gets :class:`JwksUnavailable`,
whose message names the URL and the failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import jwt

from server.runtime.metrics import Registry

log = logging.getLogger(__name__)

REFETCH_COOLDOWN_SECONDS = 30.0
"""Least time between two fetches of one JWKS (Cognito rotates keys rarely)."""

MAX_AGE_SECONDS = 3600.0
"""Keys older than this are refreshed on the next token (kept if that fails)."""

FETCH_TIMEOUT_SECONDS = 5.0


class UnknownKey(Exception):
    """The token names a key id the issuer does not publish."""


class JwksUnavailable(Exception):
    """The key is not cached and the issuer's JWKS could not be fetched."""


class JwksSource(Protocol):
    async def key(self, kid: str) -> jwt.PyJWK:
        """The signing key with this id; raises UnknownKey or JwksUnavailable."""

    async def close(self) -> None:
        """Release the HTTP client, if any."""


def parse_jwks(document: Any) -> dict[str, jwt.PyJWK]:
    """Signing keys by key id; raises ValueError on a document with no usable key."""
    try:
        key_set = jwt.PyJWKSet.from_dict(document)
    except (jwt.PyJWKSetError, jwt.PyJWKError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a usable JWKS: {exc}") from None
    return {jwk.key_id: jwk for jwk in key_set.keys if jwk.key_id is not None}


class FileJwks:
    """Keys read once from a file (offline deployments and tests)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._keys = parse_jwks(json.loads(path.read_text()))

    async def key(self, kid: str) -> jwt.PyJWK:
        key = self._keys.get(kid)
        if key is None:
            raise UnknownKey(f"token signed by an unknown key ({kid!r} is not in {self.path})")
        return key

    async def close(self) -> None:
        return None


class HttpJwks:
    """Keys fetched from ``url`` and cached; see the module docstring for the rules."""

    def __init__(
        self,
        url: str,
        *,
        cooldown: float = REFETCH_COOLDOWN_SECONDS,
        max_age: float = MAX_AGE_SECONDS,
        timeout: float = FETCH_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        metrics: Registry | None = None,
    ) -> None:
        registry = metrics or Registry()
        self._fetches = registry.counter(
            "ap_jwks_fetches_total", "JWKS documents requested from an issuer"
        )
        self._fetch_failures = registry.counter(
            "ap_jwks_fetch_failures_total", "JWKS requests that failed (cached keys kept)"
        )
        self.url = url
        self._cooldown = cooldown
        self._max_age = max_age
        self._timeout = timeout
        self._clock = clock
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched_at: float | None = None  # last successful fetch
        self._attempted_at: float | None = None  # last fetch, successful or not
        self._attempts = 0
        self._error: str | None = None  # why the last fetch failed; None after a success
        self._lock = asyncio.Lock()
        self._http: aiohttp.ClientSession | None = None

    @property
    def attempts(self) -> int:
        """How many fetches were made (for tests and metrics)."""
        return self._attempts

    async def key(self, kid: str) -> jwt.PyJWK:
        key = self._keys.get(kid)
        if key is not None and not self._stale():
            return key
        if self._may_fetch():
            await self._refresh()
            key = self._keys.get(kid)
        if key is not None:
            return key  # possibly stale: an outage must not lock out known keys
        if self._error is not None:
            raise JwksUnavailable(
                f"signing keys unavailable: key {kid!r} is not cached and "
                f"GET {self.url} failed: {self._error}"
            )
        raise UnknownKey(f"token signed by an unknown key ({kid!r})")

    def _stale(self) -> bool:
        return self._fetched_at is None or self._clock() - self._fetched_at > self._max_age

    def _may_fetch(self) -> bool:
        return self._attempted_at is None or self._clock() - self._attempted_at >= self._cooldown

    async def _refresh(self) -> None:
        attempts = self._attempts
        async with self._lock:
            if self._attempts != attempts:
                return  # another token fetched while this one waited: use its result
            self._attempts += 1
            self._attempted_at = self._clock()
            self._fetches.inc()
            try:
                keys = parse_jwks(await self._get())
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self._fetch_failures.inc()
                self._error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.warning(
                    "JWKS fetch from %s failed (%s); keeping %d cached keys",
                    self.url,
                    self._error,
                    len(self._keys),
                )
                return
            self._keys = keys
            self._fetched_at = self._clock()
            self._error = None

    async def _get(self) -> Any:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))
        async with self._http.get(self.url) as response:
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}")
            return json.loads(await response.read())

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None


def jwks_source(issuer: str, path: Path | None, metrics: Registry | None = None) -> JwksSource:
    """The pool's keys: from ``path`` when given, else from the issuer's JWKS URL."""
    if path is not None:
        return FileJwks(path)
    return HttpJwks(f"{issuer.rstrip('/')}/.well-known/jwks.json", metrics=metrics)
