"""Command line: ``ap-realtime serve``, ``create-table``, ``dev-token``, ``seed-bot``."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Coroutine, Sequence
from typing import Any, NoReturn

from server import __version__, config
from server.store.base import StoreUnavailable

TABLE_SETTINGS = ("dynamodb_endpoint", "table", "region")
TOKEN_SETTINGS = ("dev_jwt_secret",)


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


NO_CREDENTIALS_HINT = (
    " (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; any values do for a local DynamoDB or moto)"
)


def _fail(message: str) -> int:
    if "NoCredentialsError" in message:
        message += NO_CREDENTIALS_HINT
    print(f"ap-realtime: {message}", file=sys.stderr)
    return 2


def _serve(args: argparse.Namespace) -> int:
    settings = config.load(args)
    from server.runtime import logs

    logs.configure(settings.log_level, settings.log_format, settings.node_id)
    from server.app import serve_forever

    try:
        _run(serve_forever(settings))
    except (StoreUnavailable, OSError) as exc:
        return _fail(f"cannot start: {exc}")
    return 0


def _create_table(args: argparse.Namespace) -> int:
    settings = config.load(args)
    from server.store.dynamodb import create_table

    try:
        _run(create_table(settings.dynamodb_endpoint, settings.table, settings.region))
    except StoreUnavailable as exc:
        return _fail(str(exc))
    print(f"table {settings.table} is ready, with TTL on 'ttl'")
    return 0


def _dev_token(args: argparse.Namespace) -> int:
    import jwt

    settings = config.load(args)
    if not settings.dev_jwt_secret:
        return _fail("dev-token needs --dev-jwt-secret (or AP_DEV_JWT_SECRET)")
    if args.hours <= 0:
        return _fail("--hours must be positive")
    if (args.user is None) == (args.bot is None):
        return _fail("dev-token needs --user ID (a person) or --bot CLIENT_ID (a bot)")
    now = int(time.time())
    if args.bot is not None:
        from server.auth.verify import dev_bot_claims

        claims = dev_bot_claims(args.bot, now, args.hours * 3600)
    else:
        claims = {"sub": args.user, "iat": now, "exp": now + args.hours * 3600}
    print(jwt.encode(claims, settings.dev_jwt_secret, algorithm="HS256"))
    return 0


def _seed_bot(args: argparse.Namespace) -> int:
    settings = config.load(args)
    from server.dev_bot import seed_dynamodb

    try:
        meta, game_id = _run_value(
            seed_dynamodb(
                settings.dynamodb_endpoint, settings.table, settings.region, args.client_id
            )
        )
    except StoreUnavailable as exc:
        return _fail(str(exc))
    print(
        f"BOT row {args.client_id} and game {meta}#{game_id} (the bot to move) "
        f"written to {settings.table}"
    )
    return 0


def _run_value(coro: Coroutine[Any, Any, Any]) -> Any:
    result: list[Any] = []

    async def keep() -> None:
        result.append(await coro)

    _run(keep())
    return result[0]


class _Parser(argparse.ArgumentParser):
    """Usage errors in three lines, not the whole usage (``serve`` has 70 flags)."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            2,
            f"ap-realtime: {message}\n"
            f"usage: {self.prog} {'COMMAND ' if ' ' not in self.prog else ''}[OPTIONS]"
            f"  (`{self.prog} --help` lists them)\n",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ap-realtime",
        description="Abstract Play's real-time server: WebSocket presence and game events.",
        epilog="Every setting also comes from its AP_* environment variable; "
        "`ap-realtime COMMAND --help` lists a command's own.",
    )
    parser.add_argument("--version", action="version", version=f"ap-realtime {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="run the WebSocket server (blocks until SIGINT or SIGTERM)"
    )
    config.add_arguments(serve)
    serve.set_defaults(run=_serve)
    table = commands.add_parser("create-table", help="create the DynamoDB table, TTL on")
    config.add_arguments(table, TABLE_SETTINGS)
    table.set_defaults(run=_create_table)
    token = commands.add_parser("dev-token", help="mint an HS256 development token")
    config.add_arguments(token, TOKEN_SETTINGS)
    token.add_argument("--user", help="user id, the token's sub")
    token.add_argument(
        "--bot",
        metavar="CLIENT_ID",
        help="a bot token for this client id instead (the node needs its BOT row)",
    )
    token.add_argument(
        "--hours", type=int, default=24, help="hours until the token expires (default 24)"
    )
    token.set_defaults(run=_dev_token)
    seed = commands.add_parser(
        "seed-bot", help="write a BOT row and a game where it is to move (try a bot locally)"
    )
    config.add_arguments(seed, TABLE_SETTINGS)
    seed.add_argument("--client-id", required=True, help="the bot's client id (its player id)")
    seed.set_defaults(run=_seed_bot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except config.ConfigError as exc:
        return _fail(str(exc))
    return code


if __name__ == "__main__":
    sys.exit(main())
