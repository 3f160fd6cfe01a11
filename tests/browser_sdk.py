"""The browser SDK (``clients/js``) built once per test session, from its sources.

Every test of the SDK runs against a bundle built from the working tree here, never
a stale ``dist/``: the build takes well under a second. ``scripts/bootstrap``
installs its npm packages (esbuild, typescript) with ``npm ci``.

Once per test run, not once per process: the build starts by deleting ``dist/`` and
``build/``, so a pytest-xdist worker building while another's browser loads the bundle
made that page fail (``ENOENT``). The first worker builds under a lock and leaves a
stamp naming the run; the others find it and use that build.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SDK_DIR = Path(__file__).resolve().parents[1] / "clients" / "js"
BUNDLE = SDK_DIR / "dist" / "realtime.js"
STAMP = SDK_DIR / "build" / "test-run.json"
"""Which test run built ``dist/`` and ``build/``, and the sizes that build printed."""


def node() -> str:
    path = shutil.which("node")
    assert path, "node is needed for the browser SDK: see scripts/bootstrap"
    return path


def _test_run() -> str:
    """The same in every worker of one pytest-xdist run; this process otherwise."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid {os.getpid()}"


def _lock_path() -> Path:
    # Outside the tree: the build deletes build/ and dist/.
    checkout = hashlib.sha1(str(SDK_DIR).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"ap-realtime-sdk-build-{checkout}.lock"


@functools.cache
def build() -> dict[str, int]:
    """Build dist/ and build/lib once per test run; the sizes the build printed
    (bytes minified, gzipped)."""
    assert (SDK_DIR / "node_modules" / "esbuild").is_dir(), "run scripts/bootstrap"
    run = _test_run()
    with _lock_path().open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        try:
            stamp = json.loads(STAMP.read_text())
        except (OSError, ValueError):
            stamp = {}
        if stamp.get("run") == run and BUNDLE.is_file():
            sizes: dict[str, int] = stamp["sizes"]
            return sizes
        result = subprocess.run(
            [node(), "build.mjs"], cwd=SDK_DIR, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stdout + result.stderr
        sizes = json.loads(result.stdout.strip().splitlines()[-1])
        STAMP.write_text(json.dumps({"run": run, "sizes": sizes}))
        return sizes
