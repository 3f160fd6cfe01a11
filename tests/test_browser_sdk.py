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
import subprocess

from tests.browser_sdk import BUNDLE, SDK_DIR, build, node

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
