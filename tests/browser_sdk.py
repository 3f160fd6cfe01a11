"""The browser SDK (``clients/js``) built once per test session, from its sources.

Every test of the SDK runs against a bundle built from the working tree here, never
a stale ``dist/``: the build takes well under a second. ``scripts/bootstrap``
installs its npm packages (esbuild, typescript) with ``npm ci``.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path

SDK_DIR = Path(__file__).resolve().parents[1] / "clients" / "js"
BUNDLE = SDK_DIR / "dist" / "realtime.js"


def node() -> str:
    path = shutil.which("node")
    assert path, "node is needed for the browser SDK: see scripts/bootstrap"
    return path


@functools.cache
def build() -> dict[str, int]:
    """Build dist/ and build/lib; the sizes the build printed (bytes minified, gzipped)."""
    assert (SDK_DIR / "node_modules" / "esbuild").is_dir(), "run scripts/bootstrap"
    result = subprocess.run(
        [node(), "build.mjs"], cwd=SDK_DIR, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    sizes: dict[str, int] = json.loads(result.stdout.strip().splitlines()[-1])
    return sizes
