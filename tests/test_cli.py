"""The console command, as a user runs it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from importlib.metadata import version
from pathlib import Path

import jwt
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

import server
from tests.client import DEV_SECRET, Client


def own_loopback(argv: list[str]) -> list[str]:
    """``argv`` in a network namespace of its own where one can be made (root, as CI
    runs), so the fixed default ports cannot be taken by another run on the machine."""
    if shutil.which("unshare") and shutil.which("ip"):
        probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "-", *argv]
    return argv


def as_in_readme(line: str) -> str:
    """A log line without its time and host name, to compare with the README's."""
    text = line.strip().split(" ", 2)[2]
    return re.sub(r", node [^,]+,", ", node NODE,", text)


def readme_log_lines() -> list[str]:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return [as_in_readme(line) for line in readme.splitlines() if " ap_realtime: " in line]


def test_serve_with_no_flags_starts_the_embedded_default_and_says_where() -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AP_")}
    process = subprocess.Popen(
        own_loopback([sys.executable, "-m", "server", "serve"]),
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
            if "every client is refused" in line or not line:
                break
        listening = [line for line in lines if "ws://" in line]
        assert listening, "".join(lines)
        assert "ws://127.0.0.1:8765" in listening[0]
        assert "http://127.0.0.1:8766" in listening[0]
        assert "embedded" in listening[0]
        # With no secret at all it says, plainly, that it lets nobody in and why.
        assert "accepts NO tokens (refuses everyone)" in listening[0]
        assert any("every client is refused" in line and "--dev" in line for line in lines)
        # The README shows these two lines as they are (copied from a run).
        said = [as_in_readme(line) for line in lines if "ap_realtime:" in line]
        assert said == [line for line in readme_log_lines() if "refuse" in line], said
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

    # Redis is unreachable, so start-up retries (for START_TIMEOUT, were it not stopped).
    process = await asyncio.create_subprocess_exec(
        *SERVE_ANY_PORT,
        *("--redis-url", f"redis://127.0.0.1:{free_port()}/0"),
        *("--dynamodb-endpoint", dynamodb_endpoint, "--table", table),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    lines: list[str] = []
    async with asyncio.timeout(60):  # until start-up says it is waiting, however slowly
        while not any("waiting for Redis" in line or "did not answer" in line for line in lines):
            line = (await process.stdout.readline()).decode()
            assert line, "".join(lines)  # it exited instead
            lines.append(line)
    process.send_signal(signal.SIGTERM)
    raw, _ = await asyncio.wait_for(process.communicate(), 60)
    output = "".join(lines) + raw.decode()
    # Cancelled, not left to wait out its retries (which end in "cannot start").
    assert "stopped during start-up" in output, output
    assert "cannot start" not in output, output
    assert "Unclosed" not in output and "Traceback" not in output, output
    assert process.returncode == 0, output


async def test_usr1_and_usr2_show_what_a_node_waits_for_and_it_serves_on() -> None:
    """The operator's (and the cluster harness's) look into a node that will not stop:
    ``kill -USR1`` writes its asyncio tasks with their stacks, ``kill -USR2`` its threads."""
    process = await asyncio.create_subprocess_exec(
        *SERVE_ANY_PORT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert process.stdout is not None
    stdout = process.stdout
    lines: list[str] = []

    async def read_until(marker: str) -> list[str]:
        start = len(lines)
        while not lines or marker not in lines[-1]:
            line = (await stdout.readline()).decode()
            assert line, "".join(lines)  # it exited instead
            lines.append(line)
        return lines[start:]

    try:
        async with asyncio.timeout(60):  # however slowly a loaded machine starts it
            listening = await read_until("ws://")
            process.send_signal(signal.SIGUSR1)
            dump = await read_until("--- end of tasks ---")
            process.send_signal(signal.SIGUSR2)
            threads = await read_until("File ")  # the first frame of the first thread
            address = re.search(r"ws://[0-9.]+:[0-9]+", listening[-1])
            assert address is not None, listening[-1]
            async with connect(address.group(0) + "/") as socket:
                await (await socket.ping())  # it still takes connections and answers
        header = re.search(r"--- (\d+) asyncio tasks ---", "".join(dump))
        assert header is not None, "".join(dump)
        named = [line for line in dump if line.startswith("task ")]
        assert len(named) == int(header.group(1)) > 0, "".join(dump)
        assert any("Stack for" in line for line in dump), "".join(dump)
        assert any("most recent call first" in line for line in threads), "".join(threads)
        # Neither signal stopped it: SIGTERM still drains and exits cleanly.
        process.send_signal(signal.SIGTERM)
        rest, _ = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    output = "".join(lines) + rest.decode()
    assert process.returncode == 0, output
    assert "Traceback" not in output, output


def test_version_is_the_packages() -> None:
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ap-realtime {server.__version__}"
    assert version("ap-realtime") == server.__version__


def test_a_bad_value_is_one_error_and_one_line_of_usage() -> None:
    cases = {
        ("serve", "--port", "99999"): "--port must be from 1 to 65535",
        ("serve", "--http-port", "70000"): "--http-port must be from 1 to 65535",
        ("serve", "--port", "-1"): "--port must be from 1 to 65535",
        ("serve", "--port", "eighty"): "argument --port: invalid int value: 'eighty'",
        ("serve", "--publish-secret", "abc"): "--publish-secret must be at least 16 characters",
        ("serve", "--no-such-flag"): "unrecognized arguments: --no-such-flag",
        ("dev-token", "--hours", "x", "--user", "u"): "argument --hours: invalid int value",
    }
    for argv, expected in cases.items():
        result = run_cli(*argv)
        assert result.returncode == 2, (argv, result.stderr)
        lines = result.stderr.splitlines()
        assert lines[0].startswith("ap-realtime: ") and expected in lines[0], (argv, lines)
        # A setting's own check says all; the parser's adds one line of usage.
        assert len(lines) <= 2, (argv, lines)
        assert all(line.startswith("usage: ap-realtime ") for line in lines[1:]), lines


def test_help_names_each_default_once() -> None:
    serve = " ".join(run_cli("serve", "--help").stdout.split())
    options = serve[serve.index("options:") :]
    node_id = options[options.index("--node-id NODE_ID") : options.index("--dev-jwt-secret")]
    assert node_id.count("default") == 1, node_id


async def test_dev_mode_prints_a_token_and_a_publish_command_that_work() -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AP_")}
    process = await asyncio.create_subprocess_exec(
        *SERVE_ANY_PORT,
        "--dev",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=environ,
    )
    assert process.stdout is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(60):
            while not any(line.lstrip().startswith("curl ") for line in lines):
                line = (await process.stdout.readline()).decode()
                assert line, "".join(lines)
                lines.append(line)
        said = "".join(lines)
        assert "accepts dev tokens (HS256); publish on" in said, said
        started = [as_in_readme(line) for line in lines if " ap_realtime: " in line]
        readme = [line for line in readme_log_lines() if "accepts dev tokens" in line]
        assert [re.sub(r":\d+", ":PORT", line) for line in started] == [
            re.sub(r":\d+", ":PORT", line) for line in readme
        ], started
        commands = [line.strip() for line in lines]
        ws_url = next(c for c in commands if c.startswith("python -m websockets ")).split()[-1]
        subscribe = json.loads(next(c for c in commands if c.startswith('{"action"')))
        secret = next(c for c in commands if c.startswith("export AP_DEV_JWT_SECRET="))
        assert len(secret.split("=", 1)[1]) >= 32
        curl = shlex.split(next(c for c in commands if c.startswith("curl ")))
        header, body, url = curl[curl.index("-H") + 1], curl[curl.index("-d") + 1], curl[-1]

        client = await Client.open(ws_url)
        snapshots = client.presence.snapshots
        await client.send(subscribe)
        await client.wait_for(lambda: client.presence.snapshots > snapshots)
        await client.wait_for(lambda: client.presence.visible == {"alice"}, 10)  # own join
        name, _, value = header.partition(": ")
        request = urllib.request.Request(url, data=body.encode(), headers={name: value})
        with await asyncio.to_thread(urllib.request.urlopen, request, timeout=10) as response:
            assert response.status == 202
        event = await client.next_message(lambda m: m.get("verb") == "game")
        assert event["payload"] == {"meta": "chess", "id": "g1"}
        with contextlib.suppress(ConnectionClosed):
            await client.close()
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0
