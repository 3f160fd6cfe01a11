"""One settings object, from command-line flags and ``AP_*`` environment variables.

A flag wins over its variable; the variable wins over the default. Each
setting's variable is its flag in upper case with ``AP_`` in front:
``--presence-debounce-ms`` is ``AP_PRESENCE_DEBOUNCE_MS``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.bus.streams import StreamLimits


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8765
    http_host: str = "127.0.0.1"
    http_port: int = 8766
    node_id: str = ""
    dev_jwt_secret: str | None = None
    publish_secret: str | None = None
    cognito_issuer: str | None = None
    cognito_client_id: str | None = None
    jwks_file: Path | None = None
    bot_cognito_issuer: str | None = None
    bot_scope: str | None = None
    bot_jwks_file: Path | None = None
    bot_max_connections: int = 4
    presence_debounce_ms: int = 1000
    outbox_limit_bytes: int = 1024 * 1024
    write_delay_ms: float = 2.0
    ping_interval: float = 20.0
    ping_timeout: float = 20.0
    close_timeout: float = 5.0
    listen_backlog: int = 4096
    ttl_refresh_seconds: float = 3600.0
    dynamodb_endpoint: str | None = None
    table: str = "abstract-play-dev"
    region: str = "us-east-1"
    store: str = "memory"
    redis_url: str | None = None
    redis_cluster_url: str | None = None
    stream_audit_seconds: float = 30.0
    node_heartbeat_ms: int = 2000
    node_timeout_ms: int = 10000
    history_size: int = 50
    history_ttl: float = 900.0
    stream_meta_ttl: float = 24 * 3600.0
    history_patience_seconds: float = 30.0
    chat_rate: int = 5
    log_level: str = "INFO"
    log_format: str = "text"
    drain_seconds: float = 10.0
    drain_move_grace_ms: int = 5000
    sqs_queue_url: str | None = None
    sqs_endpoint: str | None = None
    sqs_pollers: int = 4
    sqs_wait_seconds: int = 20
    sqs_visibility_seconds: int = 30
    bot_queue_url: str | None = None
    bot_webhook_queue_url: str | None = None
    bot_challenges_by_webhook: bool = False
    dev_bot: str | None = None
    notifications_from_stream: bool = False
    stream_poll_ms: int = 500
    max_connections: int = 30000
    max_connections_per_user: int = 20
    accept_rate: float = 2000.0
    accept_queue_seconds: float = 3.0
    subscribe_timeout: float = 10.0
    max_watched_games_per_user: int = 5000
    flood_credits: int = 50
    flood_window_seconds: float = 20.0
    socket_send_buffer_bytes: int = 64 * 1024
    token_cache_size: int = 10000
    heartbeat_seconds: int = 15
    dev: bool = False

    @property
    def presence_debounce(self) -> float:
        return self.presence_debounce_ms / 1000

    @property
    def stream_limits(self) -> StreamLimits:
        from server.bus.streams import StreamLimits

        return StreamLimits(self.history_size, self.history_ttl, self.stream_meta_ttl)

    @property
    def clustered(self) -> bool:
        return self.redis_url is not None or self.redis_cluster_url is not None


_HELP: dict[str, str] = {
    "host": "public WebSocket listener address",
    "port": "public WebSocket listener port, 1-65535 or 0 for any free one (any path is accepted)",
    "http_host": "internal HTTP listener address (publish, health, metrics)",
    "http_port": "internal HTTP listener port, 1-65535 or 0 for any free one; for operators and "
    "the backend only",
    "node_id": "this node's name, stored as each row's endpoint",
    "dev_jwt_secret": "accept HS256 development tokens signed with this secret (at least 32 "
    "characters)",
    "publish_secret": "bearer secret required by POST /publish (at least 16 characters); "
    "without one, publishing is off",
    "cognito_issuer": "Cognito user pool issuer URL; enables RS256 ID tokens",
    "cognito_client_id": "Cognito app client id, the ID tokens' audience",
    "jwks_file": "read the pool's JWKS from this file instead of the issuer URL",
    "bot_cognito_issuer": "Cognito bot pool issuer URL; enables bot access tokens",
    "bot_scope": "OAuth scope every bot access token must carry (with --bot-cognito-issuer)",
    "bot_jwks_file": "read the bot pool's JWKS from this file instead of the issuer URL",
    "bot_max_connections": "most connections one bot may hold on one node",
    "presence_debounce_ms": "window over which presence joins and leaves coalesce",
    "outbox_limit_bytes": "bytes a client may have unsent (user space plus the kernel's send "
    "queue, pongs included) before it is closed as slow (4008)",
    "write_delay_ms": "while the node is busy, at most this long a frame may wait so that "
    "more frames share a socket's write (0: each loop turn's frames leave at its end)",
    "ping_interval": "seconds between keepalive pings",
    "ping_timeout": "seconds to wait for a pong before dropping the peer",
    "close_timeout": "seconds to wait for a closing handshake before dropping the socket",
    "listen_backlog": "listen(2) backlog of the WebSocket listener, for connect storms",
    "ttl_refresh_seconds": "how often live connections push their row's ttl forward",
    "dynamodb_endpoint": "DynamoDB endpoint URL; implies --store dynamodb",
    "table": "DynamoDB table name",
    "region": "AWS region of the table",
    "store": "where connection rows and the presence seq are kept",
    "redis_url": "Redis URL; makes this process one node of a cluster",
    "redis_cluster_url": (
        "Redis Cluster seed nodes, redis://host:port[,redis://host:port...]; like "
        "--redis-url, over a Redis Cluster with sharded pub/sub"
    ),
    "stream_audit_seconds": "how often a cluster node checks that it heard every event of the "
    "streams it holds (0: never)",
    "node_heartbeat_ms": "how often a node renews its heartbeat in Redis",
    "node_timeout_ms": "silence after which a node is declared dead and its users leave",
    "history_size": "events kept per stream for recovery after a reconnect",
    "history_ttl": "seconds a stream's history is kept after its last event",
    "stream_meta_ttl": "seconds a stream's epoch and top offset are kept after its last event",
    "history_patience_seconds": "seconds a recovery or a stream repair keeps trying its history "
    "read while Redis is away, before it answers recovered: false",
    "chat_rate": "most chat comments one user may post per 10 s (cluster-wide when clustered)",
    "log_level": "least severe log level written",
    "log_format": "text for people, json for a log collector (one object per line)",
    "drain_seconds": "on SIGTERM, spread closing the clients (1012) over this many seconds",
    "drain_move_grace_ms": "a drained user counts as online this long, to reconnect elsewhere",
    "sqs_queue_url": "consume today's broadcast queue (WEBSOCKET_SQS) at this URL; off by default",
    "sqs_endpoint": "SQS endpoint URL (a local SQS or moto); default: AWS in --region",
    "sqs_pollers": "concurrent long polls of the queue on this node, 10 messages each",
    "sqs_wait_seconds": "long-poll wait of each ReceiveMessage (0-20)",
    "sqs_visibility_seconds": "how long a received message stays hidden from other consumers",
    "bot_queue_url": "consume today's bot outbound queue (BOT_OUTBOUND_QUEUE_URL) at this URL: "
    "turns and challenges to connected bots; off by default (uses the --sqs-* options)",
    "bot_webhook_queue_url": "forward, unchanged, the bot queue's messages for bots with no "
    "WebSocket session to this queue (the webhook Lambda's; FIFO for exactly once)",
    "bot_challenges_by_webhook": "forward every challenge to --bot-webhook-queue-url, even for "
    "a bot with a session: today only the webhook's 200 accepts one (botQuery has no verb "
    "for it)",
    "dev_bot": "with the embedded store: write a BOT row for this client id and a game where "
    "it is to move, at start (try it with: ap-realtime dev-token --bot ID)",
    "notifications_from_stream": "push NOTIFICATION# rows to their users from the table's stream",
    "stream_poll_ms": "pause between GetRecords calls on a shard that had nothing new",
    "max_connections": "open sockets this node accepts; over it upgrades get HTTP 503 "
    "(3x the 10,000 a node is sized for, ~20 KiB each; 0 = no cap)",
    "max_connections_per_user": "sockets one user may hold on this node; the next is closed "
    "with 4509 (a browser opens one per tab; 20 tabs is generous)",
    "accept_rate": "new connections in any one second (a sliding window); over it "
    "upgrades wait their turn, up to --accept-queue-seconds, then get HTTP 503 with "
    "Retry-After (above the ~1,200/s one core completes; 0 = off)",
    "accept_queue_seconds": "longest an upgrade over --accept-rate is held for its turn before "
    "it gets HTTP 503: a storm is paced, not refused (0 = refuse at once; below 10, the "
    "handshake's own timeout)",
    "subscribe_timeout": "seconds a socket may stay open without subscribing before 4408 "
    "(a browser subscribes within a second of connecting)",
    "max_watched_games_per_user": "games one user may watch across all sockets on this node "
    "(~1 KiB each; 20 tabs x 250 games)",
    "flood_credits": "credits a socket may spend per --flood-window-seconds, also its burst; "
    "a frame (data, ping, pong) costs 1, plus 1 per full 4 KiB; over it: error rate_limited, "
    "then close 1008 (a browser sends a few frames a minute)",
    "flood_window_seconds": "window over which --flood-credits refill",
    "socket_send_buffer_bytes": "SO_SNDBUF of each client socket: bounds the kernel's part of "
    "the outbox instead of letting it autotune to 4 MiB (0 = kernel default)",
    "heartbeat_seconds": "seconds between the heartbeat frames sent to sockets that asked "
    "for them in subscribe (1-300); an SDK replaces a socket silent for 3 of these",
    "token_cache_size": "verified tokens remembered (LRU, by hash, never past exp) so a "
    "reconnect storm verifies each token once (0 = off)",
    "dev": "try-out mode: throwaway --dev-jwt-secret and --publish-secret (those not given), "
    "and a ready token and publish command printed at start; never in production",
}

_CHOICES: dict[str, tuple[str, ...]] = {
    "store": ("memory", "dynamodb"),
    "log_level": ("DEBUG", "INFO", "WARNING", "ERROR"),
    "log_format": ("text", "json"),
}

MIN_DEV_SECRET_CHARS = 32
MIN_PUBLISH_SECRET_CHARS = 16
MAX_PORT = 65535
MAX_WRITE_DELAY_MS = 100.0

SERVE = tuple(spec.name for spec in fields(Settings))
"""The settings ``serve`` takes: all of them."""


class ConfigError(Exception):
    """A setting is missing, malformed or contradicts another; the message says which."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, names: Sequence[str] = SERVE) -> None:
    """Add one flag per named setting; defaults stay None so the environment can fill them.

    The help shows the real default and the variable, since argparse sees only None.
    """
    defaults = Settings()
    for name in names:
        kind = _parser_type(name)
        # A bare boolean flag means true; ``--flag false`` is accepted too.
        extra: dict[str, Any] = {"nargs": "?", "const": True} if kind is _bool_value else {}
        default = getattr(defaults, name)
        shown = "host name" if name == "node_id" else ("none" if default is None else default)
        parser.add_argument(
            _flag(name),
            dest=name,
            type=kind,
            default=None,
            choices=_CHOICES.get(name),
            metavar=name.upper() if name in _CHOICES else None,
            help=_help_text(name, shown),
            **extra,
        )


def _help_text(name: str, shown: object) -> str:
    choices = _CHOICES.get(name)
    within = f"; one of {', '.join(choices)}" if choices else ""
    # argparse formats help with %: a literal % must be doubled.
    return f"{_HELP[name]}{within} (default {shown}; env AP_{name.upper()})".replace("%", "%%")


def _parser_type(name: str) -> Callable[[str], Any]:
    return str.upper if name == "log_level" else _field_type(name)


def _bool_value(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{raw!r} is not true or false")


def _field_type(name: str) -> Any:
    default = getattr(Settings(), name)
    if name.endswith("jwks_file"):
        return Path
    if isinstance(default, bool):
        return _bool_value
    if isinstance(default, bool | str) or default is None:
        return str
    return type(default)


def load(args: argparse.Namespace | None, environ: Mapping[str, str] | None = None) -> Settings:
    """Build settings from parsed flags over environment variables over defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for spec in fields(Settings):
        flag_value = getattr(args, spec.name, None) if args is not None else None
        if flag_value is not None:
            values[spec.name] = flag_value
            continue
        raw = environ.get(f"AP_{spec.name.upper()}")
        if raw is not None and raw != "":
            try:
                values[spec.name] = _parser_type(spec.name)(raw)
            except ValueError:
                raise ConfigError(f"AP_{spec.name.upper()}={raw!r} is not a valid value") from None
            choices = _CHOICES.get(spec.name)
            if choices is not None and values[spec.name] not in choices:
                raise ConfigError(
                    f"AP_{spec.name.upper()}={raw!r} must be one of {', '.join(choices)}"
                )
    if not values.get("node_id"):
        values["node_id"] = socket.gethostname()
    if values.get("dynamodb_endpoint") and "store" not in values:
        values["store"] = "dynamodb"
    if values.get("dev"):
        # Throwaway secrets for this run only; given ones are kept.
        values.setdefault("dev_jwt_secret", secrets.token_hex(32))
        values.setdefault("publish_secret", secrets.token_hex(16))
    settings = Settings(**values)
    _validate(settings)
    return settings


def _validate(settings: Settings) -> None:
    for name in ("port", "http_port"):
        if not 0 <= getattr(settings, name) <= MAX_PORT:
            raise ConfigError(
                f"{_flag(name)} must be from 1 to {MAX_PORT} (or 0 for any free port), "
                f"not {getattr(settings, name)}"
            )
    if settings.store not in ("memory", "dynamodb"):
        raise ConfigError(f"--store must be memory or dynamodb, not {settings.store!r}")
    if settings.redis_url is not None and settings.redis_cluster_url is not None:
        raise ConfigError("--redis-url and --redis-cluster-url exclude each other: pick one")
    if settings.redis_cluster_url is not None:
        from server.redis.client import startup_nodes

        try:
            startup_nodes(settings.redis_cluster_url)
        except ValueError as exc:
            raise ConfigError(f"--redis-cluster-url: {exc}") from None
    if settings.clustered and settings.store == "memory":
        flag = "--redis-url" if settings.redis_url is not None else "--redis-cluster-url"
        raise ConfigError(
            f"{flag} needs a shared store: add --dynamodb-endpoint or --store dynamodb"
        )
    if (settings.cognito_issuer is None) != (settings.cognito_client_id is None):
        raise ConfigError("--cognito-issuer and --cognito-client-id go together")
    if (settings.bot_cognito_issuer is None) != (settings.bot_scope is None):
        raise ConfigError("--bot-cognito-issuer and --bot-scope go together")
    bot_pool, human_pool = settings.bot_cognito_issuer, settings.cognito_issuer
    if bot_pool and human_pool and bot_pool.rstrip("/") == human_pool.rstrip("/"):
        raise ConfigError("--bot-cognito-issuer must be the bot pool, not the human pool")
    if settings.bot_max_connections < 1:
        raise ConfigError("--bot-max-connections must be at least 1")
    if settings.history_size < 1:
        raise ConfigError("--history-size must be at least 1")
    if settings.history_ttl <= 0 or settings.stream_meta_ttl < settings.history_ttl:
        raise ConfigError("--history-ttl must be positive and at most --stream-meta-ttl")
    if settings.presence_debounce_ms < 0:
        raise ConfigError("--presence-debounce-ms must not be negative")
    if settings.drain_seconds < 0 or settings.drain_move_grace_ms < 0:
        raise ConfigError("--drain-seconds and --drain-move-grace-ms must not be negative")
    if settings.dev_jwt_secret is not None and len(settings.dev_jwt_secret) < MIN_DEV_SECRET_CHARS:
        raise ConfigError(
            f"--dev-jwt-secret must be at least {MIN_DEV_SECRET_CHARS} characters "
            f"(try: openssl rand -hex 32)"
        )
    if (
        settings.publish_secret is not None
        and len(settings.publish_secret) < MIN_PUBLISH_SECRET_CHARS
    ):
        raise ConfigError(
            f"--publish-secret must be at least {MIN_PUBLISH_SECRET_CHARS} characters "
            f"(try: openssl rand -hex 16)"
        )
    if not 0 <= settings.sqs_wait_seconds <= 20:
        raise ConfigError("--sqs-wait-seconds must be from 0 to 20 (SQS's own limit)")
    if settings.sqs_pollers < 1:
        raise ConfigError("--sqs-pollers must be at least 1")
    if not 1 <= settings.sqs_visibility_seconds <= 43_200:
        raise ConfigError("--sqs-visibility-seconds must be from 1 to 43200 (SQS's own limit)")
    if (settings.bot_queue_url is None) != (settings.bot_webhook_queue_url is None):
        raise ConfigError(
            "--bot-queue-url and --bot-webhook-queue-url go together: once the server reads "
            "the bot queue, messages for bots without a socket go on to the webhook queue"
        )
    if settings.bot_challenges_by_webhook and settings.bot_queue_url is None:
        raise ConfigError("--bot-challenges-by-webhook needs --bot-queue-url")
    if settings.dev_bot is not None and settings.store != "memory":
        raise ConfigError(
            "--dev-bot seeds the embedded store; for DynamoDB use: ap-realtime seed-bot"
        )
    if settings.notifications_from_stream and settings.store != "dynamodb":
        raise ConfigError(
            "--notifications-from-stream reads the table's stream and keeps its checkpoints "
            "in the table: add --store dynamodb (or --dynamodb-endpoint)"
        )
    if settings.stream_poll_ms < 200:
        raise ConfigError("--stream-poll-ms must be at least 200 (5 GetRecords/s per shard)")
    for name in (
        "max_connections",
        "accept_rate",
        "subscribe_timeout",
        "socket_send_buffer_bytes",
        "token_cache_size",
    ):
        if getattr(settings, name) < 0:
            raise ConfigError(f"{_flag(name)} must not be negative")
    for name in (
        "max_connections_per_user",
        "max_watched_games_per_user",
        "flood_credits",
        "flood_window_seconds",
        "history_patience_seconds",
        "ping_interval",  # the keepalive sweep sleeps a share of these
        "ping_timeout",
    ):
        if getattr(settings, name) <= 0:
            raise ConfigError(f"{_flag(name)} must be positive")
    if not 0 <= settings.write_delay_ms <= MAX_WRITE_DELAY_MS:
        raise ConfigError(
            f"--write-delay-ms must be from 0 to {MAX_WRITE_DELAY_MS:g} (a frame waits at most "
            "this long, and its outbox is checked once per write)"
        )
    if settings.stream_audit_seconds < 0:
        raise ConfigError("--stream-audit-seconds must be 0 (off) or positive")
    if not 0 <= settings.accept_queue_seconds <= 8:
        raise ConfigError(
            "--accept-queue-seconds must be from 0 to 8 (a held upgrade must still finish "
            "within the 10 s handshake timeout)"
        )
    if settings.chat_rate < 1:
        raise ConfigError("--chat-rate must be at least 1")
    if not 1 <= settings.heartbeat_seconds <= 300:
        raise ConfigError("--heartbeat-seconds must be from 1 to 300")


def parse(argv: Sequence[str] | None = None) -> Settings:
    """Settings for ``serve`` from a command line (used by tests and tools)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return load(parser.parse_args(argv))
