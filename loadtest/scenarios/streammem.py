"""``streammem``: Redis memory per stream, measured with the real Lua script.

``-n`` streams (game streams, the common case) are written through
``RedisStreams`` into a fresh ``redis-server``, and ``INFO memory``'s
``used_memory`` is read between phases:

1. every stream gets one event (a new stream: meta hash, history of one);
2. every stream is filled to ``--history-size`` events (a busy stream at its cap);
3. one more event per stream (at the cap, so the history does not grow: MAXLEN holds;
   the event's name key is new);
4. the histories are dropped, as their ttl would (an idle stream: its meta, and the
   names of its events until their window ends).

The figure the issue asks for is phase 2's bytes per active stream.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from loadtest.harness.runner import Run
from loadtest.harness.servers import start_redis
from protocol.envelope import encode_envelope
from protocol.messages import Broadcast, GameEvent
from server.bus.redis_streams import RedisStreams, history_key
from server.bus.streams import Append, StreamLimits

BATCH = 500
HISTORY_SIZE = 50


def _event(meta: str, game_id: str) -> bytes:
    """A game event as the backend sends it: meta, id and little else."""
    payload = {"meta": meta, "id": game_id}
    return encode_envelope(Broadcast(GameEvent("game", meta, game_id, payload)))


async def _used(client: aioredis.Redis) -> int:
    info = await client.info("memory")
    return int(info["used_memory"])


async def _append_round(streams: RedisStreams, names: list[str], events: dict[str, bytes]) -> None:
    for start in range(0, len(names), BATCH):
        chunk = [Append(n, events[n], (n,)) for n in names[start : start + BATCH]]
        await streams.append_many(chunk)


async def streammem(run: Run) -> dict[str, Any]:
    count = run.options.connections
    proc, url = await start_redis()
    run.procs.append(proc)
    client: aioredis.Redis = aioredis.Redis.from_url(url)
    streams = RedisStreams(url, StreamLimits(history_size=HISTORY_SIZE))
    try:
        names = [f"game:homeworlds#{uuid.uuid4()}" for _ in range(count)]
        events = {name: _event("homeworlds", name.split("#", 1)[1]) for name in names}
        envelope_bytes = len(next(iter(events.values())))
        await client.config_set("activedefrag", "no")
        empty = await _used(client)
        started = time.monotonic()
        await _append_round(streams, names, events)
        one = await _used(client)
        for _ in range(HISTORY_SIZE - 1):
            await _append_round(streams, names, events)
        full = await _used(client)
        await _append_round(streams, names, events)
        capped = await _used(client)
        elapsed = time.monotonic() - started
        appended = count * (HISTORY_SIZE + 1)
        sample = await streams.read(names[0], 0)
        for start in range(0, count, BATCH):
            await client.delete(*[history_key(n) for n in names[start : start + BATCH]])
        meta_only = await _used(client)
    finally:
        await streams.close()
        await client.aclose()

    def per(value: int) -> float:
        return round(value / count, 1)

    figures = {
        "streams": count,
        "history_size": HISTORY_SIZE,
        "envelope_bytes": envelope_bytes,
        "kept_after_cap": len(sample.entries),
        "top_after_cap": sample.top,
        "bytes_per_stream_one_event": per(one - empty),
        "bytes_per_stream_full_history": per(full - empty),
        "bytes_per_stream_meta_only": per(meta_only - empty),
        "growth_past_cap_bytes_per_stream": per(capped - full),
        "appends_per_s": round(appended / elapsed, 1) if elapsed > 0 else 0.0,
        "used_memory_bytes": {"empty": empty, "one": one, "full": full, "meta_only": meta_only},
    }
    print("streammem: " + json.dumps(figures))
    return {"servers": {"redis": figures}, "targets": []}
