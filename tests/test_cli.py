"""The console command, as a user runs it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import jwt

from tests.client import DEV_SECRET


def test_serve_with_no_flags_starts_the_embedded_default_and_says_where() -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AP_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environ,
    )
    try:
        deadline = time.monotonic() + 20
        lines: list[str] = []
        assert process.stdout is not None
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            lines.append(line)
            if "ws://" in line or not line:
                break
        listening = [line for line in lines if "ws://" in line]
        assert listening, "".join(lines)
        assert "ws://127.0.0.1:8765" in listening[0]
        assert "http://127.0.0.1:8766" in listening[0]
        assert "embedded" in listening[0]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_dev_token_mints_a_verifiable_token() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "dev-token",
            "--dev-jwt-secret",
            DEV_SECRET,
            "--user",
            "alice",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    claims = jwt.decode(result.stdout.strip(), DEV_SECRET, algorithms=["HS256"])
    assert claims["sub"] == "alice" and claims["exp"] > time.time()


def test_a_taken_port_exits_non_zero_with_a_message() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "server", "serve", "--port", str(port), "--http-port", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 2
    assert "cannot start" in result.stderr


SERVE_ANY_PORT = [sys.executable, "-m", "server", "serve", "--port", "0", "--http-port", "0"]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AP_")}
    return subprocess.run(
        [sys.executable, "-m", "server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environ, **(env or {})},
    )


def test_help_shows_defaults_choices_and_only_each_commands_own_flags() -> None:
    serve = " ".join(run_cli("serve", "--help").stdout.split())
    assert "(default 8765; env AP_PORT)" in serve
    assert "one of memory, dynamodb" in serve and "one of text, json" in serve
    assert "--drain-seconds" in serve
    token = " ".join(run_cli("dev-token", "--help").stdout.split())
    assert "--hours" in token and "hours until the token expires" in token
    assert "--port" not in token and "--redis-url" not in token
    table = run_cli("create-table", "--help").stdout
    assert "--table" in table and "--dynamodb-endpoint" in table and "--port" not in table


def test_config_errors_say_ap_realtime_and_exit_2_without_a_traceback() -> None:
    cases = [
        run_cli("serve", "--dev-jwt-secret", "short"),
        run_cli("dev-token", "--dev-jwt-secret", "short", "--user", "alice"),
        run_cli("serve", env={"AP_PORT": "eighty"}),
        run_cli("serve", env={"AP_REDIS_URL": "redis://127.0.0.1:1"}),
        run_cli("dev-token", "--user", "alice"),
    ]
    for result in cases:
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("ap-realtime: "), result.stderr
        assert "Traceback" not in result.stderr
    assert "at least 32 characters" in cases[0].stderr and "at least 32" in cases[1].stderr


def test_log_format_json_writes_one_object_per_line_with_the_node_id() -> None:
    process = subprocess.Popen(
        [*SERVE_ANY_PORT, "--log-format", "json", "--node-id", "json-node"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        while "ws://" not in first and first:
            first = process.stdout.readline()
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = [first, *rest.splitlines()]
    records = [json.loads(line) for line in lines if line.strip()]
    assert records and all(r["node"] == "json-node" for r in records)
    assert any("ws://" in r["msg"] for r in records)
    assert {"ts", "level", "logger", "msg"} <= set(records[0])


async def test_a_signal_during_start_up_stops_it_at_once_and_leaks_nothing(
    dynamodb_endpoint: str, table: str
) -> None:
    from tests.services import free_port

    # Redis is unreachable, so start-up retries (for 30 s, were it not stopped).
    process = await asyncio.create_subprocess_exec(
        *SERVE_ANY_PORT,
        *("--redis-url", f"redis://127.0.0.1:{free_port()}/0"),
        *("--dynamodb-endpoint", dynamodb_endpoint, "--table", table),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    await asyncio.sleep(4)
    assert process.returncode is None, "start-up should still be waiting"
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    raw, _ = await asyncio.wait_for(process.communicate(), 20)
    output = raw.decode()
    assert time.monotonic() - signalled < 5, output
    assert "waiting for Redis" in output or "did not answer" in output, output
    assert "Unclosed" not in output and "Traceback" not in output, output
    assert process.returncode == 0, output
