"""Every Lua script is a ``.lua`` file that some module runs, and Redis compiles each one.

A script nobody loads is dead code that no test would notice; a script that does
not compile fails only on the path that first runs it. ``SCRIPT LOAD`` compiles
without running, against a real ``redis-server``.
"""

from __future__ import annotations

import hashlib
import importlib
import pkgutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

import server
from server.redis.scripts import for_bus, loaded
from tests.services import redis_url_for_tests

ROOT = Path(server.__file__).resolve().parent


def import_every_server_module() -> None:
    for module in pkgutil.walk_packages(server.__path__, "server."):
        importlib.import_module(module.name)


def lua_files_on_disk() -> set[str]:
    return {str(path.relative_to(ROOT.parent)) for path in ROOT.rglob("lua/*.lua")}


def lua_files_loaded() -> set[str]:
    files: set[str] = set()
    for name in loaded():
        package, names = name.split(":")
        folder = package.replace(".", "/") + "/lua/"
        files.update(folder + part + ".lua" for part in names.split("+"))
    return files


def test_every_lua_file_is_loaded_by_a_module_and_nothing_else_is_lua() -> None:
    import_every_server_module()
    on_disk = lua_files_on_disk()
    assert on_disk, "no .lua file found under server/"
    assert lua_files_loaded() == on_disk
    # No script left inline in Python: a script names its keys as KEYS[n].
    inline = [
        str(path.relative_to(ROOT.parent))
        for path in ROOT.rglob("*.py")
        if "KEYS[" in path.read_text(encoding="utf-8")
    ]
    assert inline == []


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_url_for_tests() as url:
        yield url


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.Redis.from_url(redis_url)
    yield redis
    await redis.aclose()


async def test_every_script_compiles_in_redis(client: aioredis.Redis) -> None:
    import_every_server_module()
    scripts = loaded()
    assert scripts
    for name, source in scripts.items():
        variants = {source, for_bus(source, sharded=True)}
        for variant in variants:
            sha = await client.script_load(variant)
            assert sha == hashlib.sha1(variant.encode()).hexdigest(), name
