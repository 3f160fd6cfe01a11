"""The baseline: the least a server can do to serve the same load with ``websockets``.

It speaks the subset of the protocol the load uses, and nothing else:

- ``subscribe`` and ``syncPresence`` get a snapshot-shaped frame (no
  presence is tracked: ``seq`` 0, the connection count, no user ids), unless
  ``wantsPresence`` is false; the token is not checked;
- ``subscribe`` and ``watchGames`` replace the connection's watch set in one
  dict from game to connections;
- ``POST /publish`` (aiohttp, the same HTTP stack as our server, behind the
  same bearer secret) encodes the ``{"verb","payload"}`` frame once and hands
  it to ``websockets.broadcast`` for the game's watchers.

Compression is off and the listen backlog is 4096, as in our server, so the
comparison is between routing code and not between settings. Run it with
``python -m loadtest.harness.baseline_server --port P --http-port H --publish-secret X``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from typing import Any

from aiohttp import web
from websockets.asyncio.server import ServerConnection, broadcast, serve
from websockets.exceptions import ConnectionClosed

Watchers = dict[str, set[ServerConnection]]


class Baseline:
    def __init__(self, publish_secret: str) -> None:
        self.watchers: Watchers = {}
        self.connections = 0
        self.bearer = f"Bearer {publish_secret}"

    def snapshot(self) -> str:
        return (
            '{"verb":"connections","payload":{"type":"snapshot","seq":0,'
            f'"totalCount":{self.connections},"visibleUserIds":[]}}}}'
        )

    def watch(self, ws: ServerConnection, old: set[str], games: Any) -> set[str]:
        new: set[str] = set()
        if isinstance(games, list):
            for ref in games:
                if isinstance(ref, dict) and ref.get("meta") and ref.get("id"):
                    new.add(f"{ref['meta']}#{ref['id']}")
        for key in old - new:
            watchers = self.watchers.get(key)
            if watchers is not None:
                watchers.discard(ws)
                if not watchers:
                    del self.watchers[key]
        for key in new - old:
            self.watchers.setdefault(key, set()).add(ws)
        return new

    async def handler(self, ws: ServerConnection) -> None:
        self.connections += 1
        watching: set[str] = set()
        try:
            async for data in ws:
                try:
                    message = json.loads(data)
                    action = message.get("action")
                except (ValueError, AttributeError):
                    continue
                if action == "subscribe":
                    watching = self.watch(ws, watching, message.get("games"))
                    if message.get("wantsPresence") is not False:
                        await ws.send(self.snapshot())
                elif action == "watchGames":
                    watching = self.watch(ws, watching, message.get("games"))
                elif action == "syncPresence":
                    await ws.send(self.snapshot())
        except ConnectionClosed:
            pass
        finally:
            self.connections -= 1
            self.watch(ws, watching, None)

    async def publish(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != self.bearer:
            return web.json_response({"error": "unauthorized"}, status=401)
        try:
            message = json.loads(await request.read())
            payload = message["payload"]
            key = f"{payload['meta']}#{payload['id']}"
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": "bad body"}, status=400)
        watchers = self.watchers.get(key)
        if watchers:
            frame = json.dumps({"verb": message["verb"], "payload": payload}, separators=(",", ":"))
            broadcast(watchers, frame)
        return web.json_response({"accepted": True}, status=202)

    async def readyz(self, request: web.Request) -> web.Response:
        return web.json_response({"ready": True})


async def main_async(host: str, port: int, http_port: int, publish_secret: str) -> None:
    baseline = Baseline(publish_secret)
    app = web.Application()
    app.router.add_post("/publish", baseline.publish)
    app.router.add_get("/readyz", baseline.readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, http_port, backlog=1024)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with serve(baseline.handler, host, port, compression=None, backlog=4096):
        await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.harness.baseline_server", description=__doc__
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--publish-secret", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from loadtest.harness.procstat import raise_fd_limit

    raise_fd_limit()
    coro = main_async(args.host, args.port, args.http_port, args.publish_secret)
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(coro)


if __name__ == "__main__":
    main()
