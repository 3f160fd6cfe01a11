"""Cognito-shaped tokens for tests: RSA pools, their JWKS, and a JWKS served over HTTP.

A :class:`Pool` is one Cognito user pool: an issuer URL and its signing keys.
Human ID tokens and bot access tokens are built with the claims Cognito puts
in them, so the server's checks meet the real shapes.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any

import jwt
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from tests.services import HOST

BOT_SCOPE = "default-m2m-resource-server-test/communicate"
HUMAN_CLIENT_ID = "human-app-client"


def new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def jwk(key: rsa.RSAPrivateKey, kid: str) -> dict[str, Any]:
    entry: dict[str, Any] = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    entry.update({"kid": kid, "alg": "RS256", "use": "sig"})
    return entry


@dataclass
class Pool:
    """A user pool: tokens are signed with ``keys[signing]`` and published in ``jwks()``."""

    issuer: str
    keys: dict[str, rsa.RSAPrivateKey] = field(default_factory=dict)
    signing: str = ""

    @classmethod
    def create(cls, issuer: str, kid: str = "key-1") -> Pool:
        return cls(issuer=issuer, keys={kid: new_key()}, signing=kid)

    def jwks(self) -> dict[str, Any]:
        return {"keys": [jwk(key, kid) for kid, key in self.keys.items()]}

    def rotate(self, kid: str, *, keep_old: bool = True) -> None:
        """Publish a new key and sign with it from now on."""
        if not keep_old:
            self.keys.clear()
        self.keys[kid] = new_key()
        self.signing = kid

    def sign(self, claims: dict[str, Any], kid: str | None = None) -> str:
        kid = kid or self.signing
        key = self.keys.get(kid) or next(iter(self.keys.values()))
        claims = {k: v for k, v in claims.items() if v is not None}
        return jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid})

    def bot_token(self, client_id: str, /, **overrides: Any) -> str:
        """An access token as the client-credentials grant returns it."""
        now = int(time.time())
        claims: dict[str, Any] = {
            "sub": client_id,
            "client_id": client_id,
            "iss": self.issuer,
            "token_use": "access",
            "scope": BOT_SCOPE,
            "auth_time": now,
            "iat": now,
            "exp": now + 3600,
            "jti": f"jti-{client_id}-{now}",
            "version": 2,
        }
        kid = overrides.pop("kid", None)
        claims.update(overrides)
        return self.sign(claims, kid)

    def id_token(self, user_id: str, /, **overrides: Any) -> str:
        """A human ID token of this pool."""
        now = int(time.time())
        claims: dict[str, Any] = {
            "sub": user_id,
            "aud": HUMAN_CLIENT_ID,
            "iss": self.issuer,
            "token_use": "id",
            "cognito:username": user_id,
            "iat": now,
            "exp": now + 3600,
        }
        kid = overrides.pop("kid", None)
        claims.update(overrides)
        return self.sign(claims, kid)


class JwksServer:
    """Serves pools' JWKS at ``<issuer path>/.well-known/jwks.json`` on 127.0.0.1.

    ``down`` makes it answer 503; ``stop()`` closes the port (connection refused).
    ``requests`` counts JWKS requests per path. ``POST /oauth2/token`` is a pool's
    token URL: the client-credentials grant for the clients added with ``add_client``.
    """

    def __init__(self) -> None:
        self.pools: dict[str, Pool] = {}
        self.down = False
        self.requests: dict[str, int] = {}
        self.port = 0
        self.clients: dict[str, tuple[str, Pool]] = {}  # client id -> (secret, pool)
        self.tokens_issued = 0
        self.token_lifetime = 3600  # expires_in of the tokens issued
        self.token_requests = 0
        self.token_down = False  # the token URL answers 503
        self._runner: web.AppRunner | None = None

    @property
    def token_url(self) -> str:
        return f"{self.base}/oauth2/token"

    def add_client(self, pool: Pool, client_id: str, secret: str) -> None:
        self.clients[client_id] = (secret, pool)

    async def _token(self, request: web.Request) -> web.Response:
        self.token_requests += 1
        if self.token_down:
            return web.Response(status=503, text="down for maintenance")
        form = await request.post()
        try:
            scheme, encoded = request.headers["Authorization"].split(" ", 1)
            client_id, secret = base64.b64decode(encoded).decode().split(":", 1)
        except (KeyError, ValueError):
            return web.json_response({"error": "invalid_client"}, status=401)
        known = self.clients.get(client_id)
        if scheme != "Basic" or known is None or known[0] != secret:
            return web.json_response({"error": "invalid_client"}, status=401)
        if form.get("grant_type") != "client_credentials" or form.get("scope") != BOT_SCOPE:
            return web.json_response({"error": "invalid_request"}, status=400)
        self.tokens_issued += 1
        lifetime = self.token_lifetime
        token = known[1].bot_token(client_id, exp=int(time.time()) + lifetime)
        return web.json_response(
            {"access_token": token, "expires_in": lifetime, "token_type": "Bearer"}
        )

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    def pool(self, name: str, kid: str = "key-1") -> Pool:
        """A new pool whose issuer is this server's ``/<name>``."""
        pool = Pool.create(f"{self.base}/{name}", kid)
        self.pools[f"/{name}/.well-known/jwks.json"] = pool
        return pool

    async def _jwks(self, request: web.Request) -> web.Response:
        self.requests[request.path] = self.requests.get(request.path, 0) + 1
        pool = self.pools.get(request.path)
        if self.down:
            return web.Response(status=503, text="down for maintenance")
        if pool is None:
            return web.Response(status=404)
        return web.json_response(pool.jwks())

    def count(self, pool: Pool) -> int:
        path = pool.issuer.removeprefix(self.base) + "/.well-known/jwks.json"
        return self.requests.get(path, 0)

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_post("/oauth2/token", self._token)
        app.router.add_get("/{tail:.*}", self._jwks)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, port or self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
