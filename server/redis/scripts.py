"""Lua scripts on one Redis or a Redis Cluster."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError


class ShardScript:
    """A Lua script on a Redis Cluster: ``EVALSHA``, and ``EVAL`` when the shard lacks it.

    redis-py's ``register_script`` answers ``NOSCRIPT`` with ``SCRIPT LOAD`` on
    every primary; many callers doing that at once (a fresh client, a replica
    just promoted) broke connections under each other's commands, and the
    client's retries then ran scripts twice. ``NOSCRIPT`` means the script did
    not run, so ``EVAL`` (which caches it on that shard) is safe to send.
    """

    def __init__(self, client: Any, script: str) -> None:
        self.client = client
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()

    async def __call__(self, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        try:
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.eval(self.script, len(keys), *keys, *args)


def script_for(client: Any, source: str) -> Any:
    """A callable script (``await script(keys=[...], args=[...])``) on one Redis or a cluster."""
    if isinstance(client, RedisCluster):
        return ShardScript(client, source)
    return client.register_script(source)
