"""The browser client's rules in a real browser: headless Chromium, real WebSocket.

`tests/browser/client.html` is the live client's presence and watch logic;
`tests/browser/run.mjs` drives two users through Playwright and checks each rule.
`scripts/bootstrap` installs Chromium (Debian) and playwright-core (npm).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

from tests.client import dev_token
from tests.conftest import PUBLISH_SECRET, RunningServer

BROWSER_DIR = Path(__file__).parent / "browser"


async def test_the_browser_client_works_unchanged(server: RunningServer) -> None:
    chromium = shutil.which("chromium")
    node = shutil.which("node")
    assert chromium and node, "run scripts/bootstrap: it installs chromium and node packages"
    assert (BROWSER_DIR / "node_modules" / "playwright-core").is_dir(), "run scripts/bootstrap"
    config = {
        "ws": server.ws_url,
        "http": server.http_url,
        "secret": PUBLISH_SECRET,
        "chromium": chromium,
        "tokens": {user: dev_token(user) for user in ("alice", "bob")},
    }
    process = await asyncio.create_subprocess_exec(
        node,
        str(BROWSER_DIR / "run.mjs"),
        json.dumps(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    lines = stdout.decode().strip().splitlines()
    assert lines, stderr.decode()
    result = json.loads(lines[-1])
    assert result["ok"], result
    assert process.returncode == 0
    assert "closing one of two tabs is not a leave" in result["steps"]
    assert result["presence"]["visible"] == ["bob"]
