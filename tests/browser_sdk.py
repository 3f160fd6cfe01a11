"""The browser SDK (``clients/js``) built for the tests, from its sources.

Every test of the SDK runs against a bundle built from the working tree here, never
a stale ``dist/``: the build takes well under a second. ``scripts/bootstrap``
installs its npm packages (esbuild, typescript) with ``npm ci``.

Once per version of the sources, not once per process or per run: the build starts
by deleting ``dist/`` and ``build/``, so a pytest-xdist worker building while another's
browser loads the bundle made that page fail (``ENOENT``), and so did a second pytest
run started beside the first in the same checkout. The first process to find the
sources changed builds, under a lock, and leaves a stamp with the sources' digest; the
others, in this run or another, find it and use that build.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

SDK_DIR = Path(__file__).resolve().parents[1] / "clients" / "js"
BUNDLE = SDK_DIR / "dist" / "realtime.js"
STAMP_NAME = "test-build.json"
"""In ``build/``: the digest of the sources ``dist/`` and ``build/`` were built from,
and the sizes that build printed."""
SOURCES = ("build.mjs", "package.json", "package-lock.json", "tsconfig.json", "src")
"""What a build reads, below the SDK's directory (``node_modules`` follows the lock file)."""


def node() -> str:
    path = shutil.which("node")
    assert path, "node is needed for the browser SDK: see scripts/bootstrap"
    return path


def sources_digest(sdk_dir: Path) -> str:
    """A digest of every file a build of ``sdk_dir`` reads, names and bytes."""
    digest = hashlib.sha256()
    for name in SOURCES:
        path = sdk_dir / name
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for file in files:
            if file.is_file():
                digest.update(str(file.relative_to(sdk_dir)).encode() + b"\0")
                digest.update(file.read_bytes() + b"\0")
    return digest.hexdigest()


def _lock_path(sdk_dir: Path) -> Path:
    # Outside the tree: the build deletes build/ and dist/.
    checkout = hashlib.sha1(str(sdk_dir).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"ap-realtime-sdk-build-{checkout}.lock"


def build_in(sdk_dir: Path) -> dict[str, int]:
    """Build ``sdk_dir``'s dist/ and build/lib unless they are from its current
    sources; the sizes the build printed (bytes minified, gzipped)."""
    assert (sdk_dir / "node_modules" / "esbuild").is_dir(), "run scripts/bootstrap"
    stamp_path = sdk_dir / "build" / STAMP_NAME
    with _lock_path(sdk_dir).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        sources = sources_digest(sdk_dir)
        try:
            stamp = json.loads(stamp_path.read_text())
        except (OSError, ValueError):
            stamp = {}
        if stamp.get("sources") == sources and (sdk_dir / "dist" / "realtime.js").is_file():
            sizes: dict[str, int] = stamp["sizes"]
            return sizes
        result = subprocess.run(
            [node(), "build.mjs"], cwd=sdk_dir, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stdout + result.stderr
        sizes = json.loads(result.stdout.strip().splitlines()[-1])
        stamp_path.write_text(json.dumps({"sources": sources, "sizes": sizes}))
        return sizes


@functools.cache
def build() -> dict[str, int]:
    """The SDK of this checkout, built once per version of its sources."""
    return build_in(SDK_DIR)
