"""Lua scripts on one Redis or a Redis Cluster, and where their sources come from.

Every script is a ``.lua`` file in the ``lua/`` folder of the package whose
modules run it (``server/presence/lua/commit.lua``), shipped as package data
and read once, when that module is imported (:func:`lua`). ``docs/lua.md``
lists them: keys, arguments, and what each one guarantees.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError


class Script:
    """A Lua script's source and the SHA1 that ``EVALSHA`` names it by."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def command(
        self, keys: Sequence[Any], args: Sequence[Any], *, cached: bool = True
    ) -> tuple[Any, ...]:
        """The command that runs it: ``EVALSHA`` by its SHA1, or ``EVAL`` with its
        source where the server may lack it (which also caches it there)."""
        if cached:
            return ("EVALSHA", self.sha, len(keys), *keys, *args)
        return ("EVAL", self.source, len(keys), *keys, *args)


class ShardScript(Script):
    """A Lua script on a Redis Cluster: ``EVALSHA``, and ``EVAL`` when the shard lacks it.

    redis-py's ``register_script`` answers ``NOSCRIPT`` with ``SCRIPT LOAD`` on
    every primary; many callers doing that at once (a fresh client, a replica
    just promoted) broke connections under each other's commands, and the
    client's retries then ran scripts twice. ``NOSCRIPT`` means the script did
    not run, so ``EVAL`` (which caches it on that shard) is safe to send.
    """

    __slots__ = ("client",)

    def __init__(self, client: Any, source: str) -> None:
        super().__init__(source)
        self.client = client

    async def __call__(self, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        try:
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.eval(self.source, len(keys), *keys, *args)


def script_for(client: Any, source: str) -> Any:
    """A callable script (``await script(keys=[...], args=[...])``) on one Redis or a cluster."""
    if isinstance(client, RedisCluster):
        return ShardScript(client, source)
    return client.register_script(source)


_loaded: dict[str, str] = {}


def lua(package: str, *names: str, values: Mapping[str, object] | None = None) -> str:
    """The script made of ``<package>/lua/<name>.lua`` files, joined in order.

    Each name in ``values`` is replaced by its value's text: constants the
    scripts share with Python (``ENVELOPE_VERSION``), kept in one place.
    """
    folder = resources.files(package).joinpath("lua")
    source = "".join(folder.joinpath(f"{name}.lua").read_text(encoding="utf-8") for name in names)
    for name, value in (values or {}).items():
        source = source.replace(name, str(value))
    _loaded[f"{package}:{'+'.join(names)}"] = source
    return source


def loaded() -> dict[str, str]:
    """Every script read so far, by ``<package>:<names>``: what the tests check."""
    return dict(_loaded)


def for_bus(script: str, *, sharded: bool) -> str:
    """The script as it must run: ``SPUBLISH`` on a Redis Cluster, ``PUBLISH`` on one Redis.

    A plain ``PUBLISH`` on a cluster is broadcast to every node; ``SPUBLISH``
    stays on the shard of the channel's slot, which is the script's own slot.
    """
    return script.replace("redis.call('PUBLISH'", "redis.call('SPUBLISH'") if sharded else script
