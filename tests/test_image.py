"""The container image: built with podman (scripts/build-image), then run as it is.

There is no container engine that can run it here (``podman run`` cannot set
rlimits on this host), so the test mounts the built image and runs its own
entrypoint, user and environment with ``chroot``: what runs is the image's
content, configured only by ``AP_*`` variables. Slow (a first build makes the
base image with mmdebstrap); needs root, as CI has.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
from packaging.utils import canonicalize_name
from packaging.version import Version

import server as server_package
from tests.client import DEV_SECRET, Client
from tests.pins import read_pins
from tests.services import free_port

ROOT = Path(__file__).resolve().parents[1]
TAG = "localhost/ap-realtime:test"


def podman(*args: str) -> str:
    return subprocess.run(
        ["podman", *args], check=True, capture_output=True, text=True, timeout=120
    ).stdout.strip()


def chroot_command(
    mount: str, config: dict[str, Any], env: dict[str, str], *argv: str
) -> list[str]:
    """``argv`` as the image would run it: its user, its environment plus ``env``."""
    user = config["User"]
    image_env = dict(item.split("=", 1) for item in config["Env"])
    merged = [f"{k}={v}" for k, v in {**image_env, **env}.items()]
    return ["chroot", f"--userspec={user}", mount, "/usr/bin/env", "-i", *merged, *argv]


def site_packages(mount: str) -> Path:
    (site,) = Path(mount).glob("opt/ap-realtime/lib/python3*/site-packages")
    return site


def packages_in(mount: str) -> set[str]:
    """The top-level packages in the image's virtual environment."""
    return {path.parent.name for path in site_packages(mount).glob("*/__init__.py")}


def distributions_in(mount: str) -> dict[str, Version]:
    """Each distribution installed in the image's virtual environment, and its version."""
    found: dict[str, Version] = {}
    for info in site_packages(mount).glob("*.dist-info"):
        name, version = info.name.removesuffix(".dist-info").rsplit("-", 1)
        found[canonicalize_name(name)] = Version(version)
    return found


async def http_status(url: str) -> int | None:
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response,
        ):
            return response.status
    except (aiohttp.ClientError, TimeoutError):
        return None


async def test_the_image_runs_ap_realtime_serve_from_ap_variables_as_a_non_root_user() -> None:
    assert os.geteuid() == 0, "the image test needs root (podman storage, chroot), as CI has"
    build = await asyncio.to_thread(
        subprocess.run,
        [str(ROOT / "scripts" / "build-image"), TAG],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stderr[-4000:]

    config = json.loads(podman("image", "inspect", TAG, "--format", "{{json .Config}}"))
    health = json.loads(podman("image", "inspect", TAG, "--format", "{{json .HealthCheck}}"))
    assert config["Entrypoint"] == ["ap-realtime", "serve"] and not config.get("Cmd")
    assert config["User"].split(":")[0] not in ("", "0", "root")
    assert "AP_HOST=0.0.0.0" in config["Env"]
    assert health["Test"][0] == "CMD" and "/healthz" in health["Test"][-1]
    labels = json.loads(podman("image", "inspect", TAG, "--format", "{{json .Labels}}"))
    assert labels["org.opencontainers.image.version"] == server_package.__version__

    port, http_port = free_port(), free_port()
    env = {
        "AP_PORT": str(port),
        "AP_HTTP_PORT": str(http_port),
        "AP_DEV_JWT_SECRET": DEV_SECRET,
        "AP_NODE_ID": "image-test",
        "AP_DRAIN_SECONDS": "1",
    }
    mount = podman("image", "mount", TAG)
    try:
        # The server's packages, and not the load tester (it runs from a checkout).
        installed = packages_in(mount)
        assert {"server", "protocol"} <= installed and "loadtest" not in installed
        # What CI tested, to the version (constraints.txt). Unpinned: the venv's own
        # pip and setuptools, and redis-py's async-timeout, only for Debian's Python
        # 3.11.2, which the tests' Python does not ask for.
        distributions, pins = distributions_in(mount), read_pins()
        assert distributions.pop("ap-realtime") == Version(server_package.__version__)
        unpinned = set(distributions) - set(pins)
        assert unpinned <= {"async-timeout", "pip", "setuptools"}, unpinned
        drifted = {n: v for n, v in distributions.items() if n in pins and v != pins[n]}
        assert not drifted, f"the image's versions differ from constraints.txt: {drifted}"
        server = await asyncio.create_subprocess_exec(
            *chroot_command(mount, config, env, *config["Entrypoint"]),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            deadline = asyncio.get_running_loop().time() + 120
            while await http_status(f"http://127.0.0.1:{http_port}/healthz") != 200:
                assert server.returncode is None, "the image's server exited"
                assert asyncio.get_running_loop().time() < deadline, "no /healthz in 120 s"
                await asyncio.sleep(0.1)

            # The image's own HEALTHCHECK command, run inside it.
            check = await asyncio.create_subprocess_exec(
                *chroot_command(mount, config, env, *health["Test"][1:])
            )
            assert await asyncio.wait_for(check.wait(), 30) == 0

            client = await Client.open(f"ws://127.0.0.1:{port}/")
            await client.subscribe("alice")
            assert client.presence.seq is not None
            await client.close()
        finally:
            if server.returncode is None:
                server.terminate()
            output, _ = await asyncio.wait_for(server.communicate(), 30)
        log = output.decode()
        assert server.returncode == 0, log
        assert f"ws://0.0.0.0:{port}" in log and "node image-test" in log, log
    finally:
        podman("image", "unmount", TAG)
