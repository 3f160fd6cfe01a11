"""Token verification: Cognito ID tokens (RS256, JWKS) and development tokens (HS256).

The algorithm a token may use is decided by which verifier accepts it, never
by the token: each verifier pins exactly one algorithm, so ``alg: none`` and
HS/RS confusion are refused before any key is touched.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt

from server.metrics import REGISTRY
from server.token_cache import TokenCache

CLOCK_SKEW_SECONDS = 30

token_cache_hits = REGISTRY.counter(
    "ap_token_cache_hits_total", "Tokens accepted from the verified-token cache"
)


class AuthError(Exception):
    """The token was refused; the message says why, without secrets."""


@dataclass(frozen=True, slots=True)
class Identity:
    user_id: str


class CognitoVerifier:
    """Cognito ID tokens: RS256, issuer, audience = app client id, ``token_use`` = id."""

    def __init__(self, issuer: str, client_id: str, jwks_file: Path | None = None) -> None:
        self._issuer = issuer.rstrip("/")
        self._client_id = client_id
        self._keys: dict[str, jwt.PyJWK] = {}
        self._client: jwt.PyJWKClient | None = None
        if jwks_file is not None:
            self._keys = _load_jwks(json.loads(jwks_file.read_text()))
        else:
            self._client = jwt.PyJWKClient(f"{self._issuer}/.well-known/jwks.json", lifespan=3600)

    async def _key(self, kid: str) -> jwt.PyJWK:
        key = self._keys.get(kid)
        if key is not None:
            return key
        if self._client is None:
            raise AuthError("token signed by an unknown key")
        try:
            # PyJWKClient does blocking HTTP; keep it off the event loop.
            return await asyncio.to_thread(self._client.get_signing_key, kid)
        except jwt.PyJWKClientError as exc:
            raise AuthError(f"no signing key: {exc}") from None

    async def verify(self, token: str, header: dict[str, Any]) -> Identity:
        kid = header.get("kid")
        if not isinstance(kid, str):
            raise AuthError("token has no key id")
        key = await self._key(kid)
        claims = _decode(
            token,
            key.key,
            "RS256",
            issuer=self._issuer,
            audience=self._client_id,
        )
        if claims.get("token_use") != "id":
            raise AuthError("not an ID token")
        return _identity(claims)


class DevVerifier:
    """HS256 tokens signed with the development secret; ``sub`` is the user id."""

    def __init__(self, secret: str) -> None:
        if len(secret) < 32:
            raise ValueError("the development JWT secret must be at least 32 characters")
        self._secret = secret

    async def verify(self, token: str, header: dict[str, Any]) -> Identity:
        return _identity(_decode(token, self._secret, "HS256"))


class Authenticator:
    """Routes a token to the verifier of its algorithm, if that verifier is enabled."""

    def __init__(
        self, cognito: CognitoVerifier | None, dev: DevVerifier | None, cache_size: int = 0
    ) -> None:
        self._cognito = cognito
        self._dev = dev
        self.cache: TokenCache[Identity] = TokenCache(cache_size)

    @property
    def enabled(self) -> bool:
        return self._cognito is not None or self._dev is not None

    async def verify(self, token: str) -> Identity:
        identity = self.cache.get(token)
        if identity is not None:
            token_cache_hits.inc()
            return identity
        identity = await self._verify(token)
        if self.cache.size > 0:
            # Verified just now, so exp is present (required) and trustworthy.
            claims = jwt.decode(token, options={"verify_signature": False})
            self.cache.put(token, identity, float(claims["exp"]))
        return identity

    async def _verify(self, token: str) -> Identity:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise AuthError("token is malformed") from None
        alg = header.get("alg")
        if alg == "RS256" and self._cognito is not None:
            return await self._cognito.verify(token, header)
        if alg == "HS256" and self._dev is not None:
            return await self._dev.verify(token, header)
        raise AuthError(f"token algorithm {alg!r} is not accepted")


def _decode(
    token: str,
    key: Any,
    algorithm: str,
    *,
    issuer: str | None = None,
    audience: str | None = None,
) -> dict[str, Any]:
    # Every token expires: a development token without exp would be good forever.
    required = ["sub", "exp"]
    if issuer is not None:
        required += ["iss", "aud"]
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            key,
            algorithms=[algorithm],
            issuer=issuer,
            audience=audience,
            leeway=CLOCK_SKEW_SECONDS,
            options={"require": required, "verify_aud": audience is not None},
        )
    except jwt.ExpiredSignatureError:
        raise AuthError("token has expired") from None
    except jwt.InvalidIssuerError:
        raise AuthError("token has the wrong issuer") from None
    except jwt.InvalidAudienceError:
        raise AuthError("token has the wrong audience") from None
    except jwt.InvalidTokenError as exc:
        raise AuthError(f"token is invalid: {exc}") from None
    return claims


def _identity(claims: dict[str, Any]) -> Identity:
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub:
        raise AuthError("token has no subject")
    return Identity(user_id=sub)


def _load_jwks(document: Any) -> dict[str, jwt.PyJWK]:
    keys: dict[str, jwt.PyJWK] = {}
    for jwk in jwt.PyJWKSet.from_dict(document).keys:
        if jwk.key_id is not None:
            keys[jwk.key_id] = jwk
    return keys
