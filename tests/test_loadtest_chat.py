"""The chat scenario's accounting, against a real node: a comment not acknowledged is
counted by why (refused by code, a failed send, no answer), and a connection the
server closes is counted by its close code, apart from the comments."""

from __future__ import annotations

import asyncio
import dataclasses

from loadtest.scenarios.chat import (
    GAME_ID,
    META,
    Author,
    Connections,
    Tally,
    join,
    post_at_rate,
    read_replies,
)
from server.store.memory import MemoryStore
from tests.chat_helpers import seed_game
from tests.client import DEV_SECRET
from tests.conftest import TEST_SETTINGS, run_server
from tests.rows import Rows


async def test_refusals_failed_sends_and_server_closes_are_counted_apart() -> None:
    store = MemoryStore()
    seed_game(Rows(store), (META, GAME_ID), ["author0"])
    # Four comments a 10 s window, and a socket that may send ten frames in all
    # (the subscribe and nine comments).
    settings = dataclasses.replace(
        TEST_SETTINGS, chat_rate=4, flood_credits=10, flood_window_seconds=1000
    )
    async with run_server(settings, store) as running:
        author = Author("author0")
        heard, closing = Connections(), asyncio.Event()
        await join(author, running.ws_url, DEV_SECRET)  # the subscribe: one credit
        reader = asyncio.create_task(read_replies(author, heard, closing))
        tally = Tally()
        # Nine comments: four stored, five over the chat rate, all answered.
        await post_at_rate([author], 20, 0.45, tally)
        for _ in range(1000):  # 10 s
            if not author.sent:
                break
            await asyncio.sleep(0.01)
        assert not author.sent, author.sent
        # Five more: the first is the frame past the credits (the flood close), and
        # the rest go unanswered, or fail to send once the socket is closed.
        await post_at_rate([author], 20, 0.25, tally)
        await asyncio.wait_for(reader, 10)  # the server closed the connection
    assert tally.acks == 4
    assert dict(tally.refused) == {"rate_limited": 5}
    assert heard.closed_by_server == {"1008": 1}
    assert heard.errors == {"rate_limited": 1}  # the flood's own refusal names no comment
    unanswered = sum(1 for _, counted in author.sent.values() if counted is tally)
    assert tally.acks + sum(tally.refused.values()) + tally.send_failed + unanswered == 14
    assert tally.latency.count == 4
