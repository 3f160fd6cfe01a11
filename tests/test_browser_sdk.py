"""The browser SDK's own tests: its unit tests (Node's test runner), its types, its size.

The unit tests drive the pure logic (backoff, the close-code policy, positions,
duplicates and gaps, coalescing, presence) and the client's state machine on scripted
sockets under mocked timers. The SDK against real nodes in Chromium is in
``test_browser_sdk_nodes.py``.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
from pathlib import Path

from tests.browser_sdk import BUNDLE, SDK_DIR, SOURCES, build, build_in, node

SIZE_LIMIT = 8 * 1024
"""The issue's limit: 8 KB minified and gzipped."""


def test_the_sdk_unit_tests_pass() -> None:
    build()
    files = sorted(str(path.relative_to(SDK_DIR)) for path in (SDK_DIR / "test").glob("*.test.mjs"))
    result = subprocess.run(
        [node(), "--test", "--test-reporter=tap", *files],
        cwd=SDK_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    counts = dict(re.findall(r"^# (tests|pass|fail|cancelled|skipped|todo) (\d+)$", output, re.M))
    assert result.returncode == 0, output
    assert counts["fail"] == counts["cancelled"] == counts["skipped"] == counts["todo"] == "0"
    declared = sum(len(re.findall(r"^test\(", (SDK_DIR / f).read_text(), re.M)) for f in files)
    assert int(counts["pass"]) == declared > 50, output[-3000:]


def test_the_sdk_types_check() -> None:
    """An application's use of the shipped .d.ts compiles, and its misuses do not.

    The sources themselves are checked under strict TypeScript by the build, which
    fails on any type error while it writes the declarations.
    """
    build()
    assert (SDK_DIR / "dist" / "types" / "index.d.ts").is_file()
    tsc = str(SDK_DIR / "node_modules" / "typescript" / "bin" / "tsc")
    result = subprocess.run(
        [node(), tsc, "-p", "test/tsconfig.json"],
        cwd=SDK_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_bundle_is_at_most_8_kb_minified_and_gzipped() -> None:
    sizes = build()
    code = BUNDLE.read_bytes()
    gzipped = len(gzip.compress(code, compresslevel=9))
    assert gzipped <= SIZE_LIMIT, f"{gzipped} bytes gzipped, over {SIZE_LIMIT}"
    assert sizes["minified"] == len(code)
    print(f"clients/js/dist/realtime.js: {len(code)} bytes minified, {gzipped} gzipped")
    # One self-contained module: no runtime dependencies, nothing imported.
    assert b"import" not in code
    package = json.loads((SDK_DIR / "package.json").read_text())
    assert "dependencies" not in package and "peerDependencies" not in package


def test_the_sdk_sources_are_formatted() -> None:
    """Prettier's format, as ruff's for the Python (`npm run format` writes it)."""
    prettier = str(SDK_DIR / "node_modules" / "prettier" / "bin" / "prettier.cjs")
    result = subprocess.run(
        [node(), prettier, "--check", "src", "test", "build.mjs"],
        cwd=SDK_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_build_serves_every_run_until_a_source_changes(tmp_path: Path) -> None:
    """A second pytest run beside the first, in the same checkout, finds the build of
    the same sources and uses it: building again would delete the bundle from under
    the first run's browsers. A changed source is built again."""
    sdk = tmp_path / "js"
    sdk.mkdir()
    for name in SOURCES:
        source = SDK_DIR / name
        if source.is_dir():
            shutil.copytree(source, sdk / name)
        else:
            shutil.copy2(source, sdk / name)
    (sdk / "node_modules").symlink_to(SDK_DIR / "node_modules")
    bundle = sdk / "dist" / "realtime.js"

    first = build_in(sdk)
    built = bundle.stat().st_mtime_ns
    assert first["minified"] == bundle.stat().st_size
    assert build_in(sdk) == first
    assert bundle.stat().st_mtime_ns == built  # not built again

    index = sdk / "src" / "index.ts"
    index.write_text(index.read_text() + "\nexport const buildProbe = 1;\n")
    build_in(sdk)
    assert bundle.stat().st_mtime_ns != built
    assert b"buildProbe" in bundle.read_bytes()
