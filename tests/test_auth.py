"""Token verification: Cognito RS256 with a JWKS file, dev HS256, and every refusal."""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from server.auth.jwks import FileJwks
from server.auth.verify import Authenticator, AuthError, CognitoVerifier, DevVerifier
from tests.client import DEV_SECRET, dev_token
from tests.conftest import TEST_SETTINGS, RunningServer, run_server

ISSUER = "https://cognito-idp.us-east-1.amazonaws.com/us-east-1_TestPool"
CLIENT_ID = "test-app-client"


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def jwks_file(rsa_key: rsa.RSAPrivateKey, tmp_path_factory: pytest.TempPathFactory) -> Path:
    jwk = json.loads(RSAAlgorithm.to_jwk(rsa_key.public_key()))
    jwk.update({"kid": "key-1", "alg": "RS256", "use": "sig"})
    path = tmp_path_factory.mktemp("jwks") / "jwks.json"
    path.write_text(json.dumps({"keys": [jwk]}))
    return path


def cognito_token(key: rsa.RSAPrivateKey, **overrides: Any) -> str:
    now = int(time.time())
    claims: dict[str, Any] = {
        "sub": "user-123",
        "iss": ISSUER,
        "aud": CLIENT_ID,
        "token_use": "id",
        "iat": now,
        "exp": now + 600,
    }
    headers = {"kid": overrides.pop("kid", "key-1")}
    claims.update(overrides)
    claims = {k: v for k, v in claims.items() if v is not None}
    return jwt.encode(claims, key, algorithm="RS256", headers=headers)


@pytest.fixture
def authenticator(jwks_file: Path) -> Authenticator:
    return Authenticator(
        cognito=CognitoVerifier(ISSUER, CLIENT_ID, FileJwks(jwks_file)), dev=DevVerifier(DEV_SECRET)
    )


async def test_cognito_id_token_is_accepted(
    authenticator: Authenticator, rsa_key: rsa.RSAPrivateKey
) -> None:
    identity = await authenticator.verify(cognito_token(rsa_key))
    assert identity.user_id == "user-123"


async def test_dev_token_is_accepted(authenticator: Authenticator) -> None:
    assert (await authenticator.verify(dev_token("dev-user"))).user_id == "dev-user"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"exp": int(time.time()) - 3600}, "expired"),
        ({"iss": "https://evil.example/pool"}, "issuer"),
        ({"aud": "another-client"}, "audience"),
        ({"token_use": "access"}, "ID token"),
        ({"token_use": None}, "ID token"),
        ({"kid": "unknown-key"}, "unknown key"),
        ({"sub": None}, "sub"),
        ({"exp": None}, "exp"),
    ],
)
async def test_bad_cognito_tokens_are_refused(
    authenticator: Authenticator,
    rsa_key: rsa.RSAPrivateKey,
    overrides: dict[str, Any],
    reason: str,
) -> None:
    with pytest.raises(AuthError, match=reason):
        await authenticator.verify(cognito_token(rsa_key, **overrides))


async def test_token_signed_by_another_rsa_key_is_refused(authenticator: Authenticator) -> None:
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    with pytest.raises(AuthError, match="invalid"):
        await authenticator.verify(cognito_token(other))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


async def test_alg_none_is_refused(authenticator: Authenticator) -> None:
    header = _b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    body = _b64(json.dumps({"sub": "mallory", "exp": int(time.time()) + 600}).encode())
    with pytest.raises(AuthError, match="not accepted"):
        await authenticator.verify(f"{header}.{body}.")


async def test_hs256_signed_with_the_public_key_is_refused(
    authenticator: Authenticator, rsa_key: rsa.RSAPrivateKey
) -> None:
    # The classic confusion: an HS256 token whose HMAC secret is the RSA public key.
    public_pem = rsa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    claims: dict[str, Any] = {"sub": "mallory", "iss": ISSUER, "aud": CLIENT_ID, "token_use": "id"}
    claims["exp"] = int(time.time()) + 600
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "key-1"}).encode())
    body = _b64(json.dumps(claims).encode())
    import hashlib
    import hmac

    signature = hmac.new(public_pem, f"{header}.{body}".encode(), hashlib.sha256).digest()
    with pytest.raises(AuthError):
        await authenticator.verify(f"{header}.{body}.{_b64(signature)}")


async def test_rs256_is_refused_when_only_dev_tokens_are_enabled(
    rsa_key: rsa.RSAPrivateKey,
) -> None:
    dev_only = Authenticator(cognito=None, dev=DevVerifier(DEV_SECRET))
    with pytest.raises(AuthError, match="not accepted"):
        await dev_only.verify(cognito_token(rsa_key))


async def test_other_algorithms_and_garbage_are_refused(authenticator: Authenticator) -> None:
    hs512 = jwt.encode({"sub": "u"}, DEV_SECRET * 2, algorithm="HS512")
    with pytest.raises(AuthError, match="not accepted"):
        await authenticator.verify(hs512)
    with pytest.raises(AuthError, match="malformed"):
        await authenticator.verify("not-a-jwt")


async def test_dev_token_with_the_wrong_secret_or_expired_is_refused(
    authenticator: Authenticator,
) -> None:
    with pytest.raises(AuthError, match="invalid"):
        await authenticator.verify(dev_token("u", secret="another-secret-0123456789abcdef-xyz"))
    with pytest.raises(AuthError, match="expired"):
        await authenticator.verify(dev_token("u", expires_in=-3600))


async def test_nothing_is_accepted_without_a_verifier() -> None:
    assert not Authenticator(cognito=None, dev=None).enabled
    with pytest.raises(AuthError):
        await Authenticator(cognito=None, dev=None).verify(dev_token("u"))


def test_short_dev_secrets_are_refused() -> None:
    with pytest.raises(ValueError, match="32"):
        DevVerifier("short")


@pytest.fixture
async def cognito_server(jwks_file: Path) -> AsyncIterator[RunningServer]:
    settings = dataclasses.replace(
        TEST_SETTINGS,
        dev_jwt_secret=None,
        cognito_issuer=ISSUER,
        cognito_client_id=CLIENT_ID,
        jwks_file=jwks_file,
    )
    async with run_server(settings) as running:
        yield running


async def test_browser_subscribes_with_a_cognito_token_end_to_end(
    cognito_server: RunningServer, rsa_key: rsa.RSAPrivateKey
) -> None:
    client = await cognito_server.client()
    await client.subscribe("user-123", token=cognito_token(rsa_key))
    await client.wait_for(lambda: "user-123" in client.presence.visible)


async def test_dev_token_is_refused_when_only_cognito_is_configured(
    cognito_server: RunningServer,
) -> None:
    client = await cognito_server.client()
    await client.send({"action": "subscribe", "token": dev_token("u")})
    error = await client.next_message(lambda m: m["verb"] == "error")
    assert error["payload"]["code"] == "unauthorized"
    assert await client.closed() == (1008, "invalid token")
