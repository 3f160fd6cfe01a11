"""The example bot of docs/bots.md, run as written against a real node: through an
HTTP 503 at upgrade, a restart, a 1013, with every turn played once.

The code block is cut out of the guide, written to a file and imported, so a
change that breaks the guide breaks this test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import re
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from apclient import FileStorage
from protocol.errors import CloseCode
from server.ingress.websocket import refused_upgrades
from server.store import BotRecord, CurrentGame, MemoryStore
from tests.cluster.harness import eventually
from tests.conftest import TEST_SETTINGS, RunningServer, run_server
from tests.tokens import BOT_SCOPE, JwksServer

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "bots.md"
BOT = "guide-bot"
SECRET = "guide-bot-secret"


async def publish_turn(server: RunningServer, game_id: str) -> None:
    body = {"verb": "yourTurn", "users": [BOT], "payload": {"meta": "chess", "id": game_id}}
    status, reply = await server.publish(body)
    assert status == 202, reply


def example_source() -> str:
    text = GUIDE.read_text()
    found = re.search(r"<!-- example: bot\.py[^>]*-->\s*```python\n(.*?)```", text, re.DOTALL)
    assert found is not None, "docs/bots.md lost its example block"
    return found.group(1)


def load_example(tmp_path: Path) -> ModuleType:
    path = tmp_path / "bot_example.py"
    path.write_text(example_source())
    spec = importlib.util.spec_from_file_location("bot_example", path)
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
    refused = refused_upgrades.value
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
        await eventually(lambda: refused_upgrades.value > refused, 10, "a 503 at upgrade")
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
