"""Token verification: human ID tokens, bot access tokens (Cognito, RS256) and dev tokens.

The algorithm a token may use is decided by which verifier accepts it, never
by the token: each verifier pins exactly one algorithm, so ``alg: none`` and
HS/RS confusion are refused before any key is touched.

Humans and bots live in two Cognito pools with their own issuer and keys. An
RS256 token goes to the verifier of the pool its ``iss`` names; each verifier
then checks the signature with its own pool's keys and its own ``token_use``
(``id`` for humans, ``access`` for bots), so a token of one kind is never taken
for the other even if its claims were copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jwt

from server.auth.jwks import JwksSource, JwksUnavailable, UnknownKey
from server.auth.token_cache import TokenCache
from server.runtime.metrics import Registry

CLOCK_SKEW_SECONDS = 30

IdentityKind = Literal["human", "bot"]


class AuthError(Exception):
    """The token was refused; the message says why, without secrets."""


class AuthUnavailable(AuthError):
    """The token could not be checked now (the issuer's keys are unreachable)."""


@dataclass(frozen=True, slots=True)
class Identity:
    user_id: str
    kind: IdentityKind = "human"


async def _signing_key(jwks: JwksSource, header: dict[str, Any]) -> Any:
    kid = header.get("kid")
    if not isinstance(kid, str):
        raise AuthError("token has no key id")
    try:
        return (await jwks.key(kid)).key
    except UnknownKey as exc:
        raise AuthError(str(exc)) from None
    except JwksUnavailable as exc:
        raise AuthUnavailable(str(exc)) from None


class CognitoVerifier:
    """Cognito ID tokens: RS256, issuer, audience = app client id, ``token_use`` = id."""

    def __init__(self, issuer: str, client_id: str, jwks: JwksSource) -> None:
        self.issuer = issuer.rstrip("/")
        self._client_id = client_id
        self._jwks = jwks

    async def verify(self, token: str, header: dict[str, Any]) -> Identity:
        key = await _signing_key(self._jwks, header)
        claims = _decode(token, key, "RS256", issuer=self.issuer, audience=self._client_id)
        if claims.get("token_use") != "id":
            raise AuthError("not an ID token")
        return _identity(claims, "human")

    async def close(self) -> None:
        await self._jwks.close()


class BotVerifier:
    """Bot access tokens from the bot pool (client-credentials grant).

    RS256, ``exp``, ``iss`` = the bot pool, ``token_use`` = access, and the bot
    scope among the space-separated ``scope``. The bot's id is ``sub``, which
    Cognito sets to the app client id (``client_id``, when present, must agree).
    """

    def __init__(self, issuer: str, scope: str, jwks: JwksSource) -> None:
        self.issuer = issuer.rstrip("/")
        self._scope = scope
        self._jwks = jwks

    async def verify(self, token: str, header: dict[str, Any]) -> Identity:
        key = await _signing_key(self._jwks, header)
        claims = _decode(token, key, "RS256", issuer=self.issuer)
        if claims.get("token_use") != "access":
            raise AuthError("not an access token")
        scope = claims.get("scope")
        if not isinstance(scope, str) or self._scope not in scope.split():
            raise AuthError(f"token lacks the bot scope {self._scope!r}")
        identity = _identity(claims, "bot")
        client_id = claims.get("client_id")
        if client_id is not None and client_id != identity.user_id:
            raise AuthError("token's client_id and sub differ")
        return identity

    async def close(self) -> None:
        await self._jwks.close()


DEV_BOT_SCOPE = "ap-realtime-dev/bot"
"""The scope of a development bot token (``ap-realtime dev-token --bot``)."""


def dev_bot_claims(client_id: str, now: int, seconds: int) -> dict[str, Any]:
    """A development bot token's claims, shaped like a bot pool access token."""
    return {
        "sub": client_id,
        "client_id": client_id,
        "token_use": "access",
        "scope": DEV_BOT_SCOPE,
        "iat": now,
        "exp": now + seconds,
    }


class DevVerifier:
    """HS256 tokens signed with the development secret; ``sub`` is the user id.

    One with ``token_use`` = access and the development bot scope is a bot's
    (``dev-token --bot``): it is admitted as bots are, only with a ``BOT`` row.
    """

    def __init__(self, secret: str) -> None:
        if len(secret) < 32:
            raise ValueError("the development JWT secret must be at least 32 characters")
        self._secret = secret

    async def verify(self, token: str, header: dict[str, Any]) -> Identity:
        claims = _decode(token, self._secret, "HS256")
        if claims.get("token_use") != "access":
            return _identity(claims, "human")
        scope = claims.get("scope")
        if not isinstance(scope, str) or DEV_BOT_SCOPE not in scope.split():
            raise AuthError(f"a development bot token needs the scope {DEV_BOT_SCOPE!r}")
        if claims.get("client_id") != claims.get("sub"):
            raise AuthError("token's client_id and sub differ")
        return _identity(claims, "bot")


class Authenticator:
    """Routes a token to the verifier of its algorithm and pool, if that one is enabled."""

    def __init__(
        self,
        cognito: CognitoVerifier | None,
        dev: DevVerifier | None,
        bot: BotVerifier | None = None,
        cache_size: int = 0,
        metrics: Registry | None = None,
    ) -> None:
        self._cache_hits = (metrics or Registry()).counter(
            "ap_token_cache_hits_total", "Tokens accepted from the verified-token cache"
        )
        self._cognito = cognito
        self._dev = dev
        self._bot = bot
        self.cache: TokenCache[Identity] = TokenCache(cache_size)

    @property
    def enabled(self) -> bool:
        return self._cognito is not None or self._dev is not None or self._bot is not None

    async def verify(self, token: str) -> Identity:
        identity = self.cache.get(token)
        if identity is not None:
            self._cache_hits.inc()
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
        if alg == "RS256":
            verifier = self._rs256_verifier(token)
            if verifier is not None:
                return await verifier.verify(token, header)
        if alg == "HS256" and self._dev is not None:
            return await self._dev.verify(token, header)
        raise AuthError(f"token algorithm {alg!r} is not accepted")

    def _rs256_verifier(self, token: str) -> CognitoVerifier | BotVerifier | None:
        # Only picks the pool; the chosen verifier checks the issuer for real.
        if self._bot is not None and _unverified_issuer(token) == self._bot.issuer:
            return self._bot
        return self._cognito if self._cognito is not None else self._bot

    async def close(self) -> None:
        for verifier in (self._cognito, self._bot):
            if verifier is not None:
                await verifier.close()


def _unverified_issuer(token: str) -> str | None:
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.InvalidTokenError:
        return None
    issuer = claims.get("iss")
    return issuer.rstrip("/") if isinstance(issuer, str) else None


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
        required.append("iss")
    if audience is not None:
        required.append("aud")
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


def _identity(claims: dict[str, Any], kind: IdentityKind) -> Identity:
    sub = claims.get("sub")
    if not isinstance(sub, str) or not sub:
        raise AuthError("token has no subject")
    return Identity(user_id=sub, kind=kind)
