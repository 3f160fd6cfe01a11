"""The example client of docs/bots.md, run as written against a real node.

The code block is cut out of the guide, written to a file and imported, so a
change that breaks the guide breaks this test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import re
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import pytest

from protocol.errors import CloseCode
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
        TEST_SETTINGS, bot_cognito_issuer=bots.issuer, bot_scope=BOT_SCOPE
    )
    try:
        async with run_server(settings, store) as server:
            yield Setup(server, store, issuer)
    finally:
        await issuer.stop()


async def test_the_guide_example_learns_its_turns_and_reconnects(
    setup: Setup, tmp_path: Path
) -> None:
    example = load_example(tmp_path)
    setup.store.put_current_game(BOT, CurrentGame("g1", "chess", (BOT, "alice"), "0"))
    setup.store.put_current_game(BOT, CurrentGame("g2", "chess", (BOT, "alice"), "1"))
    turns: list[tuple[str, str]] = []

    async def on_turn(meta: str, game_id: str) -> None:
        turns.append((meta, game_id))

    bot = example.TurnBot(
        setup.server.ws_url, setup.issuer.token_url, BOT, SECRET, BOT_SCOPE, on_turn
    )
    task = asyncio.create_task(bot.run())
    node = setup.server.node
    try:
        await eventually(lambda: turns == [("chess", "g1")], 10, "the pending turn")
        assert setup.issuer.tokens_issued == 1
        # The server restarts the socket; meanwhile the bot must move in g2 too.
        setup.store.put_current_game(BOT, CurrentGame("g2", "chess", (BOT, "alice"), "0"))
        (session,) = node.index.by_user[BOT]
        session.close(CloseCode.SERVICE_RESTART, "server restarting")
        await eventually(lambda: len(turns) == 3, 10, "pendingTurns after the reconnect")
        assert sorted(turns[1:]) == [("chess", "g1"), ("chess", "g2")]
        (again,) = node.index.by_user[BOT]
        assert again is not session and again.is_bot
        assert setup.issuer.tokens_issued == 1  # the token was reused, not fetched again

        # Live turns arrive as yourTurn; the bot keeps its stream position.
        await publish_turn(setup.server, "g3")
        await eventually(lambda: turns[-1:] == [("chess", "g3")], 10, "a live yourTurn")
        assert bot.positions[f"user:{BOT}"]["offset"] == 1
        # Turns published while it is away are replayed when it reconnects with since.
        # 1013 makes the example wait a second or two before it reconnects.
        (session,) = node.index.by_user[BOT]
        session.close(CloseCode.TRY_AGAIN_LATER, "try again later")
        await eventually(lambda: BOT not in node.index.by_user, 10, "the bot to be gone")
        mark = len(turns)
        await publish_turn(setup.server, "g4")
        await publish_turn(setup.server, "g5")
        assert BOT not in node.index.by_user, "the example reconnected too soon for this test"
        # replayed in order, then the pendingTurns of the new subscribe
        await eventually(lambda: len(turns) == mark + 4, 10, "the replay and pendingTurns")
        assert turns[mark : mark + 2] == [("chess", "g4"), ("chess", "g5")]
        assert sorted(turns[mark + 2 :]) == [("chess", "g1"), ("chess", "g2")]
        assert bot.positions[f"user:{BOT}"]["offset"] == 3
    finally:
        await bot.stop()
        await asyncio.wait_for(task, 10)  # stop() ends run()
