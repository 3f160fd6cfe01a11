"""Settings: flags, their AP_* variables, defaults and refusals."""

from __future__ import annotations

import argparse

import pytest

from server import config


def parse(argv: list[str], environ: dict[str, str]) -> config.Settings:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.load(parser.parse_args(argv), environ)


def test_defaults_are_the_embedded_single_node() -> None:
    settings = parse([], {})
    assert (settings.host, settings.port, settings.http_port) == ("127.0.0.1", 8765, 8766)
    assert settings.store == "memory" and settings.redis_url is None
    assert settings.presence_debounce_ms == 1000
    assert settings.node_id  # the host name


def test_every_flag_has_an_environment_variable_and_flags_win() -> None:
    environ = {
        "AP_PORT": "9000",
        "AP_HTTP_PORT": "9001",
        "AP_HOST": "0.0.0.0",
        "AP_PRESENCE_DEBOUNCE_MS": "250",
        "AP_DEV_JWT_SECRET": "x" * 32,
        "AP_PUBLISH_SECRET": "p" * 16,
        "AP_NODE_ID": "node-a",
    }
    settings = parse(["--port", "9100"], environ)
    assert settings.port == 9100
    assert settings.http_port == 9001 and settings.host == "0.0.0.0"
    assert settings.presence_debounce_ms == 250
    assert settings.dev_jwt_secret == "x" * 32 and settings.publish_secret == "p" * 16
    assert settings.node_id == "node-a"


def test_the_bridges_are_off_unless_asked() -> None:
    settings = parse([], {})
    assert settings.sqs_queue_url is None and settings.notifications_from_stream is False


def test_a_bare_boolean_flag_means_true_and_its_variable_takes_words() -> None:
    store = ["--dynamodb-endpoint", "http://127.0.0.1:5000"]
    assert parse([*store, "--notifications-from-stream"], {}).notifications_from_stream is True
    assert (
        parse([*store, "--notifications-from-stream", "false"], {}).notifications_from_stream
        is False
    )
    on = parse(store, {"AP_NOTIFICATIONS_FROM_STREAM": "yes"})
    assert on.notifications_from_stream is True
    queue = parse([], {"AP_SQS_QUEUE_URL": "https://sqs.us-east-1.amazonaws.com/1/q"})
    assert queue.sqs_queue_url == "https://sqs.us-east-1.amazonaws.com/1/q"


def test_a_dynamodb_endpoint_selects_the_dynamodb_store() -> None:
    settings = parse(["--dynamodb-endpoint", "http://127.0.0.1:5000"], {})
    assert settings.store == "dynamodb"


def test_both_bridges_run_on_a_redis_cluster() -> None:
    argv = ["--dynamodb-endpoint", "http://x", "--redis-cluster-url", "redis://127.0.0.1:7000"]
    argv += ["--sqs-queue-url", "http://127.0.0.1:1/q", "--notifications-from-stream"]
    settings = parse(argv, {})
    assert settings.sqs_queue_url == "http://127.0.0.1:1/q"
    assert settings.notifications_from_stream
    assert settings.redis_cluster_url == "redis://127.0.0.1:7000"


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {"AP_PORT": "eighty"}, "AP_PORT"),
        ([], {"AP_STORE": "sqlite"}, "memory, dynamodb"),
        ([], {"AP_LOG_FORMAT": "xml"}, "text, json"),
        (["--dev-jwt-secret", "short"], {}, "at least 32 characters"),
        (["--drain-seconds", "-1"], {}, "negative"),
        (["--redis-url", "redis://127.0.0.1:1"], {}, "shared store"),
        (["--cognito-issuer", "https://x"], {}, "go together"),
        (["--presence-debounce-ms", "-1"], {}, "negative"),
        (["--sqs-wait-seconds", "21"], {}, "0 to 20"),
        (["--sqs-pollers", "0"], {}, "at least 1"),
        (["--sqs-visibility-seconds", "0"], {}, "1 to 43200"),
        (["--notifications-from-stream"], {}, "--store dynamodb"),
        ([], {"AP_NOTIFICATIONS_FROM_STREAM": "maybe"}, "AP_NOTIFICATIONS_FROM_STREAM"),
        (["--dynamodb-endpoint", "http://x", "--stream-poll-ms", "50"], {}, "at least 200"),
        (["--bot-cognito-issuer", "https://bots"], {}, "go together"),
        (["--bot-scope", "s/communicate"], {}, "go together"),
        (["--bot-max-connections", "0"], {}, "at least 1"),
        (["--bot-challenges-by-webhook"], {}, "needs --bot-queue-url"),
        (
            [
                "--bot-cognito-issuer=https://pool/",
                "--bot-scope=s",
                "--cognito-issuer=https://pool",
                "--cognito-client-id=c",
            ],
            {},
            "not the human pool",
        ),
        (["--history-size", "0"], {}, "history-size"),
        (["--history-ttl", "0"], {}, "history-ttl"),
        (["--history-ttl", "100", "--stream-meta-ttl", "50"], {}, "stream-meta-ttl"),
        (["--max-connections", "-1"], {}, "max-connections must not be negative"),
        ([], {"AP_FLOOD_CREDITS": "0"}, "flood-credits must be positive"),
        (["--flood-window-seconds", "0"], {}, "flood-window-seconds must be positive"),
        (["--ping-interval", "0"], {}, "ping-interval must be positive"),
        ([], {"AP_PING_TIMEOUT": "-1"}, "ping-timeout must be positive"),
        (["--heartbeat-seconds", "0"], {}, "heartbeat-seconds must be from 1 to 300"),
        ([], {"AP_HEARTBEAT_SECONDS": "301"}, "heartbeat-seconds must be from 1 to 300"),
        (["--stream-audit-seconds", "-1"], {}, "stream-audit-seconds must be 0"),
        (["--history-patience-seconds", "0"], {}, "history-patience-seconds must be positive"),
        (["--write-delay-ms", "-1"], {}, "write-delay-ms must be from 0 to 100"),
        (["--write-delay-ms", "250"], {}, "write-delay-ms must be from 0 to 100"),
    ],
)
def test_bad_settings_are_refused_clearly(
    argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(config.ConfigError, match=message):
        parse(argv, environ)


def test_a_bad_choice_on_the_command_line_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit) as refused:
        parse(["--store", "sqlite"], {})
    assert refused.value.code == 2


def test_log_level_is_case_insensitive_from_flags_and_environment() -> None:
    assert parse(["--log-level", "debug"], {}).log_level == "DEBUG"
    assert parse([], {"AP_LOG_LEVEL": "warning"}).log_level == "WARNING"


def test_bot_settings_from_flags_and_environment() -> None:
    settings = parse(
        ["--bot-cognito-issuer", "https://bots", "--bot-jwks-file", "/tmp/bots.json"],
        {"AP_BOT_SCOPE": "res/communicate", "AP_BOT_MAX_CONNECTIONS": "2"},
    )
    assert settings.bot_cognito_issuer == "https://bots" and settings.bot_scope == "res/communicate"
    assert str(settings.bot_jwks_file) == "/tmp/bots.json" and settings.bot_max_connections == 2
    assert parse([], {}).bot_max_connections == 4


def test_every_setting_has_help_and_a_row_in_the_operations_guide() -> None:
    from dataclasses import fields
    from pathlib import Path

    from server.config import _HELP, Settings

    guide = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    for spec in fields(Settings):
        flag = "--" + spec.name.replace("_", "-")
        assert _HELP.get(spec.name), spec.name
        assert f"`{flag}`" in guide, flag


def test_stream_limits_come_from_the_settings() -> None:
    settings = parse(["--history-size", "7"], {"AP_HISTORY_TTL": "60"})
    limits = settings.stream_limits
    assert (limits.history_size, limits.history_ttl, limits.meta_ttl) == (7, 60.0, 86400.0)
