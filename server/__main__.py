"""Command line: ``ap-realtime serve``, ``create-table``, ``dev-token``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from server import config
from server.store.base import StoreUnavailable


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _serve(args: argparse.Namespace) -> int:
    settings = config.load(args)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per socket open and close costs real CPU in a connect storm.
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.root.level))
    from server.app import serve_forever

    try:
        _run(serve_forever(settings))
    except StoreUnavailable as exc:
        print(f"ap-realtime: cannot start: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ap-realtime: cannot start: {exc}", file=sys.stderr)
        return 2
    return 0


def _create_table(args: argparse.Namespace) -> int:
    settings = config.load(args)
    from server.store.dynamodb import create_table

    try:
        _run(create_table(settings.dynamodb_endpoint, settings.table, settings.region))
    except StoreUnavailable as exc:
        print(f"ap-realtime: {exc}", file=sys.stderr)
        return 2
    print(f"table {settings.table} is ready, with TTL on 'ttl'")
    return 0


def _dev_token(args: argparse.Namespace) -> int:
    import jwt

    settings = config.load(args)
    if not settings.dev_jwt_secret:
        print("ap-realtime: dev-token needs --dev-jwt-secret", file=sys.stderr)
        return 2
    now = int(time.time())
    claims = {"sub": args.user, "iat": now, "exp": now + args.hours * 3600}
    print(jwt.encode(claims, settings.dev_jwt_secret, algorithm="HS256"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ap-realtime", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the WebSocket server")
    config.add_arguments(serve)
    serve.set_defaults(run=_serve)
    table = commands.add_parser("create-table", help="create the DynamoDB table, TTL on")
    config.add_arguments(table)
    table.set_defaults(run=_create_table)
    token = commands.add_parser("dev-token", help="mint an HS256 development token")
    config.add_arguments(token)
    token.add_argument("--user", required=True, help="user id, the token's sub")
    token.add_argument("--hours", type=int, default=24)
    token.set_defaults(run=_dev_token)
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
