"""JSON logs: one object per line, the node id always, the connection id where known."""

from __future__ import annotations

import asyncio
import json
import logging

from server.runtime import logs


def record(message: str, **extra: object) -> logging.LogRecord:
    entry = logging.LogRecord("server.node", logging.INFO, __file__, 1, message, None, None)
    for key, value in extra.items():
        setattr(entry, key, value)
    return entry


async def test_json_lines_carry_the_node_and_the_connection_of_the_task() -> None:
    formatter = logs.JsonFormatter("node-a")
    plain = json.loads(formatter.format(record("started\nsecond line")))
    assert plain["node"] == "node-a" and plain["msg"] == "started\nsecond line"
    assert "connection" not in plain and plain["level"] == "INFO"
    assert "\n" not in formatter.format(record("a\nb"))

    async def serving(connection_id: str) -> dict[str, object]:
        logs.connection_id.set(connection_id)  # as the handler does for its task
        await asyncio.sleep(0)
        result: dict[str, object] = json.loads(formatter.format(record("subscribed")))
        return result

    first, second = await asyncio.gather(serving("c1"), serving("c2"))
    assert (first["connection"], second["connection"]) == ("c1", "c2")
    assert logs.connection_id.get() is None  # each task had its own
    named = json.loads(formatter.format(record("slow", connection_id="c9")))
    assert named["connection"] == "c9"
