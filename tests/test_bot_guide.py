"""The example bot of docs/bots.md, run as written against a real node: through an
HTTP 503 at upgrade, a restart, a 1013, with every turn played once. And the guide's
five-minute walk-through, its commands run as ``ap-realtime`` processes.

The code blocks are cut out of the guide, written to a file and imported (the shell
blocks' ``ap-realtime`` lines run as they are, plus this test's ports and table), so
a change that breaks the guide breaks this test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from apclient import ClientStopped, FileStorage
from protocol.errors import CloseCode
from server.store import BotRecord, CurrentGame, MemoryStore
from tests.client import Client
from tests.conftest import TEST_SETTINGS, RunningServer, run_server
from tests.services import free_port
from tests.tokens import BOT_SCOPE, JwksServer
from tests.waiting import eventually

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "bots.md"
BOT = "guide-bot"
SECRET = "guide-bot-secret"


async def publish_turn(server: RunningServer, game_id: str) -> None:
    body = {"verb": "yourTurn", "users": [BOT], "payload": {"meta": "chess", "id": game_id}}
    status, reply = await server.publish(body)
    assert status == 202, reply


def example_source(name: str = "bot.py") -> str:
    text = GUIDE.read_text()
    pattern = rf"<!-- example: {re.escape(name)}[^>]*-->\s*```python\n(.*?)```"
    found = re.search(pattern, text, re.DOTALL)
    assert found is not None, f"docs/bots.md lost its example block {name}"
    return found.group(1)


def load_example(tmp_path: Path, name: str = "bot.py") -> ModuleType:
    module_name = "example_" + name.removesuffix(".py")
    path = tmp_path / f"{module_name}.py"
    path.write_text(example_source(name))
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class Setup:
    server: RunningServer
    store: MemoryStore
    issuer: JwksServer


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    issuer = JwksServer()
    await issuer.start()
    bots = issuer.pool("bots")
    issuer.add_client(bots, BOT, SECRET)
    store = MemoryStore()
    store.put_bot(BotRecord(client_id=BOT, name="Guide", owner="owner-1"))
    settings = dataclasses.replace(
        TEST_SETTINGS, bot_cognito_issuer=bots.issuer, bot_scope=BOT_SCOPE, max_connections=1
    )
    try:
        async with run_server(settings, store) as server:
            yield Setup(server, store, issuer)
    finally:
        await issuer.stop()


async def test_the_guide_example_plays_every_turn_through_refusals_and_reconnects(
    setup: Setup, tmp_path: Path
) -> None:
    example = load_example(tmp_path)
    setup.store.put_current_game(BOT, CurrentGame("g1", "chess", (BOT, "alice"), "0"))
    setup.store.put_current_game(BOT, CurrentGame("g2", "chess", (BOT, "alice"), "1"))
    turns: list[tuple[str, str]] = []

    async def on_turn(turn: Any) -> None:
        turns.append((turn.meta, turn.id))

    node = setup.server.node
    positions = tmp_path / "positions.json"
    # The node is full (--max-connections 1): the bot's first upgrade gets HTTP 503.
    holder = await setup.server.subscribed("someone")
    metrics = node.metrics
    refused = metrics.value("ap_refused_upgrades_total")
    task = asyncio.create_task(
        example.run_bot(
            setup.server.ws_url,
            setup.issuer.token_url,
            BOT,
            SECRET,
            BOT_SCOPE,
            on_turn,
            positions=str(positions),
        )
    )
    try:
        await eventually(
            lambda: metrics.value("ap_refused_upgrades_total") > refused, 10, "a 503 at upgrade"
        )
        assert not task.done(), "the example gave up on a 503"
        await holder.close()
        await eventually(lambda: turns == [("chess", "g1")], 30, "the pending turn")
        assert setup.issuer.tokens_issued == 1
        # The server restarts the socket; meanwhile the bot must move in g2 too.
        setup.store.put_current_game(BOT, CurrentGame("g2", "chess", (BOT, "alice"), "0"))
        (session,) = node.index.by_user[BOT]
        session.close(CloseCode.SERVICE_RESTART, "server restarting")
        # g2 is new; g1, listed again, is the same ply and is not played twice
        await eventually(lambda: len(turns) == 2, 15, "pendingTurns after the reconnect")
        assert turns[1] == ("chess", "g2")
        (again,) = node.index.by_user[BOT]
        assert again is not session and again.is_bot
        assert setup.issuer.tokens_issued == 1  # the token was reused, not fetched again

        # Live turns arrive as yourTurn; the position is stored once the turn was played.
        await publish_turn(setup.server, "g3")
        await eventually(lambda: turns[-1:] == [("chess", "g3")], 10, "a live yourTurn")
        await eventually(lambda: stored(positions) == 1, 10, "the stored position")
        # Turns published while it is away are replayed when it reconnects with since.
        # 1013 makes the bot wait at least 5 s before it reconnects.
        (session,) = node.index.by_user[BOT]
        session.close(CloseCode.TRY_AGAIN_LATER, "try again later")
        await eventually(lambda: BOT not in node.index.by_user, 10, "the bot to be gone")
        await publish_turn(setup.server, "g4")
        await publish_turn(setup.server, "g5")
        assert BOT not in node.index.by_user, "the example reconnected too soon for this test"
        await eventually(lambda: len(turns) == 5, 30, "the replay")
        assert turns[3:] == [("chess", "g4"), ("chess", "g5")]
        await eventually(lambda: stored(positions) == 3, 10, "the stored position")
    finally:
        task.cancel()  # how a bot is stopped (Ctrl-C)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
    assert task.cancelled()


def stored(path: Path) -> int | None:
    position = FileStorage(path).load().get(f"user:{BOT}")
    return None if position is None else position.offset


# ------------------------------------------------------------ the five-minute walk-through


def walkthrough(name: str) -> list[list[str]]:
    """The ``ap-realtime`` commands of one shell block of the guide, as argv lists
    (``&`` and redirections dropped: the test runs and reads them itself)."""
    text = GUIDE.read_text()
    found = re.search(rf"<!-- walkthrough: {name}[^>]*-->\s*```sh\n(.*?)```", text, re.DOTALL)
    assert found is not None, f"docs/bots.md lost its walk-through {name}"
    commands = []
    for line in found.group(1).splitlines():
        line = line.split(">")[0].strip().removesuffix("&").strip()
        if line.startswith("ap-realtime "):
            commands.append(shlex.split(line)[1:])
    return commands


def ap_realtime(argv: list[str], env: dict[str, str]) -> str:
    """One short command, as ``ap-realtime`` runs it; its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "server", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@contextlib.asynccontextmanager
async def serving(argv: list[str], env: dict[str, str], tmp_path: Path) -> AsyncIterator[str]:
    """``ap-realtime serve`` on free ports; yields its WebSocket URL once it is ready."""
    port, http_port = free_port(), free_port()
    log = (tmp_path / "serve.log").open("wb")
    process = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", "server", *argv, "--port", str(port), "--http-port", str(http_port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(_ready, http_port):
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            await asyncio.sleep(0.2)
        yield f"ws://127.0.0.1:{port}/"
    finally:
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 15)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def dev_environment(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AP_")}
    return environ | {"AP_DEV_JWT_SECRET": secrets.token_hex(32)} | extra


async def refused_as_an_unknown_bot(url: str, token: str) -> None:
    client = await Client.open(url)
    try:
        await client.send({"action": "subscribe", "token": token})
        error = await client.next_message(lambda m: m["verb"] == "error", within=10)
        assert error["payload"]["code"] == "unauthorized"
        code, _ = await client.closed(within=10)
        assert code == CloseCode.POLICY_VIOLATION
    finally:
        await client.close()


async def test_the_five_minute_walkthrough_on_the_embedded_store(tmp_path: Path) -> None:
    env = dev_environment()
    commands = walkthrough("embedded")
    (serve,) = [c for c in commands if c[0] == "serve"]
    (mint,) = [c for c in commands if c[0] == "dev-token"]
    assert "--dev-bot" in serve and "--bot" in mint
    bot = mint[mint.index("--bot") + 1]
    first_turn = load_example(tmp_path, "first_turn.py").first_turn
    async with serving(serve, env, tmp_path) as url:
        token = ap_realtime(mint, env)
        turn = await asyncio.wait_for(first_turn(url, token), 30)
        assert turn == ("chess", f"dev-game-{bot}")
        # Without a BOT row: unauthorized, then 1008, and the SDK stops.
        nobody = ap_realtime(["dev-token", "--bot", "nobody"], env)
        await refused_as_an_unknown_bot(url, nobody)
        with pytest.raises(ClientStopped):
            await asyncio.wait_for(first_turn(url, nobody), 30)


async def test_the_five_minute_walkthrough_on_dynamodb(
    tmp_path: Path, dynamodb_endpoint: str
) -> None:
    env = dev_environment()
    table = f"walkthrough-{uuid.uuid4().hex[:10]}"
    commands = [
        [dynamodb_endpoint if a == "http://localhost:8000" else a for a in c] + ["--table", table]
        for c in walkthrough("dynamodb")
    ]
    assert [c[0] for c in commands] == ["create-table", "seed-bot", "serve"]
    bot = commands[1][commands[1].index("--client-id") + 1]
    for command in commands[:2]:
        ap_realtime(command, env)
    first_turn = load_example(tmp_path, "first_turn.py").first_turn
    async with serving(commands[2], env, tmp_path) as url:
        token = ap_realtime(["dev-token", "--bot", bot], env)
        assert await asyncio.wait_for(first_turn(url, token), 30) == ("chess", f"dev-game-{bot}")
        await refused_as_an_unknown_bot(url, ap_realtime(["dev-token", "--bot", "nobody"], env))
