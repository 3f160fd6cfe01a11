"""What is shipped: the wheel (and so the image) holds the server and the Python SDK, not
the load tester, which runs from a checkout with ``python -m loadtest``."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import setuptools

import server
from loadtest.harness.servers import REPO_ROOT

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_the_server_and_the_sdk_only() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = project["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(where=str(ROOT), include=find["include"])
    assert {name.split(".")[0] for name in packages} == {"protocol", "server", "apclient"}
    assert "server.ingress" in packages and "protocol" in packages
    # One version: the package's, as `ap-realtime --version` and the image label say.
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "server.__version__"}
    assert server.__version__.count(".") == 2


def test_the_load_tester_runs_from_a_checkout() -> None:
    # Its servers and workers are children that find loadtest/ through the checkout.
    assert (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "loadtest").is_dir()
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: python -m loadtest" in done.stdout and "fanout" in done.stdout
