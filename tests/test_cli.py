"""The console command, as a user runs it."""

from __future__ import annotations

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
