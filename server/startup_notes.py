"""What a person reads when ``serve`` starts: whom it lets in, and with ``--dev``,
how to try it (a token, a client, a publish), so the first run is never a server
that silently refuses everyone."""

from __future__ import annotations

import json
import shlex
import time

import jwt

from server.config import Settings

DEV_USER = "alice"
DEV_TOKEN_HOURS = 24

NO_VERIFIER = (
    "no token verifier is set, so every client is refused at subscribe (close 1008): "
    "give --dev-jwt-secret, or --cognito-issuer with --cognito-client-id, or "
    "--bot-cognito-issuer with --bot-scope; to try it out, run `ap-realtime serve --dev`"
)


def accepted_tokens(settings: Settings) -> list[str]:
    """The kinds of token this node verifies; empty: it refuses every client."""
    kinds = []
    if settings.cognito_issuer is not None:
        kinds.append("Cognito ID tokens")
    if settings.bot_cognito_issuer is not None:
        kinds.append("bot access tokens")
    if settings.dev_jwt_secret:
        kinds.append("dev tokens (HS256)")
    return kinds


def summary(settings: Settings) -> str:
    """Who gets in and whether publishing is on, for the start-up log line."""
    kinds = accepted_tokens(settings)
    tokens = "accepts " + ", ".join(kinds) if kinds else "accepts NO tokens (refuses everyone)"
    publish = "publish on" if settings.publish_secret else "publish off (no --publish-secret)"
    return f"{tokens}; {publish}"


def _reachable(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0") else ("[::1]" if host == "::" else host)


def dev_banner(settings: Settings, ws_port: int, http_port: int) -> str:
    """``--dev``: the throwaway secrets, a ready token, and the commands to use them."""
    assert settings.dev_jwt_secret and settings.publish_secret
    now = int(time.time())
    claims = {"sub": DEV_USER, "iat": now, "exp": now + DEV_TOKEN_HOURS * 3600}
    token = jwt.encode(claims, settings.dev_jwt_secret, algorithm="HS256")
    ws_url = f"ws://{_reachable(settings.host)}:{ws_port}/"
    publish_url = f"http://{_reachable(settings.http_host)}:{http_port}/publish"
    subscribe = {"action": "subscribe", "token": token, "games": [{"meta": "chess", "id": "g1"}]}
    event = {"verb": "game", "payload": {"meta": "chess", "id": "g1"}}
    return "\n".join(
        [
            "",
            "--dev: throwaway secrets for this run only; never use --dev in production.",
            "In another shell (the same secrets let `ap-realtime dev-token` mint more tokens):",
            f"  export AP_DEV_JWT_SECRET={settings.dev_jwt_secret}",
            f"  export AP_PUBLISH_SECRET={settings.publish_secret}",
            f"A client, as {DEV_USER} ({DEV_TOKEN_HOURS} h token), watching chess#g1: run the",
            "first line, then paste the second within 10 s:",
            f"  python -m websockets {ws_url}",
            f"  {json.dumps(subscribe, separators=(',', ':'))}",
            "An event for that game, which the client prints:",
            f"  curl -H 'Authorization: Bearer {settings.publish_secret}' "
            f"-d {shlex.quote(json.dumps(event, separators=(',', ':')))} {publish_url}",
            *(
                [
                    f"A token for the bot {settings.dev_bot} (docs/bots.md, section 0):",
                    f"  ap-realtime dev-token --bot {settings.dev_bot}",
                ]
                if settings.dev_bot
                else []
            ),
            "",
        ]
    )
