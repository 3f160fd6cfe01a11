"""deploy/systemd/: the unit passes ``systemd-analyze verify``, and agrees with the server.

``verify`` runs against a scratch root (``--root``) holding the unit, the system's own
units it depends on (``sysinit.target`` and the rest), and an executable where the unit's
``ExecStart`` expects the installed ``ap-realtime``: the check is the real one, on a
machine where nothing is installed under /opt. Needs ``systemd-analyze`` (Debian's
``systemd``; scripts/bootstrap installs it).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from server.config import Settings, load

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "systemd" / "ap-realtime.service"
ENV_FILE = ROOT / "deploy" / "systemd" / "ap-realtime.env"
SYSCTL = ROOT / "deploy" / "systemd" / "60-ap-realtime.conf"
SYSTEM_UNITS = Path("/usr/lib/systemd/system")
INSTALLED = Path("/etc/systemd/system/ap-realtime.service")


def analyze() -> str:
    found = shutil.which("systemd-analyze")
    assert found is not None, "systemd-analyze is missing: run scripts/bootstrap"
    return found


def unit_settings(text: str) -> dict[str, list[str]]:
    """``Section.Key`` -> its values, in order (a key may repeat)."""
    found: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return found


def one(settings: dict[str, list[str]], key: str) -> str:
    (value,) = settings[key]
    return value


def env_file() -> dict[str, str]:
    pairs = {}
    for raw in ENV_FILE.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key] = value
    return pairs


@pytest.fixture
def scratch_root(tmp_path: Path) -> Path:
    """A root with the system's units, the unit, and a stand-in for the installed server."""
    shutil.copytree(SYSTEM_UNITS, tmp_path / SYSTEM_UNITS.relative_to("/"), symlinks=True)
    (tmp_path / INSTALLED.parent.relative_to("/")).mkdir(parents=True)
    shutil.copy(UNIT, tmp_path / INSTALLED.relative_to("/"))
    exec_start = one(unit_settings(UNIT.read_text()), "Service.ExecStart").split()[0]
    binary = tmp_path / exec_start.lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexec true\n")
    binary.chmod(0o755)
    return tmp_path


def verify(root: Path, unit: Path = INSTALLED) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [analyze(), "verify", f"--root={root}", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_unit_passes_systemd_analyze_verify(scratch_root: Path) -> None:
    result = verify(scratch_root)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_verify_in_the_scratch_root_catches_a_bad_unit(scratch_root: Path) -> None:
    """The check above can fail: a misspelt key is reported, a missing binary refused."""
    bad = scratch_root / "etc/systemd/system/bad.service"
    bad.write_text(UNIT.read_text().replace("TimeoutStopSec=", "TimeoutStopSecs="))
    result = verify(scratch_root, Path("/etc/systemd/system/bad.service"))
    assert "Unknown key 'TimeoutStopSecs'" in result.stderr

    exec_start = one(unit_settings(UNIT.read_text()), "Service.ExecStart").split()[0]
    (scratch_root / exec_start.lstrip("/")).unlink()
    result = verify(scratch_root)
    assert result.returncode != 0
    assert "is not executable" in result.stderr


def test_the_unit_is_hardened(scratch_root: Path) -> None:
    settings = unit_settings(UNIT.read_text())
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "DynamicUser": "yes",
        "RestrictSUIDSGID": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert one(settings, f"Service.{key}") == value, key
    # systemd's own score of the sandbox: 0 is the most confined, 10 the least. 2.0 or
    # less is what it calls OK (this unit: 1.2).
    result = subprocess.run(
        [
            analyze(),
            "security",
            "--offline=yes",
            f"--root={scratch_root}",
            "--threshold=20",
            str(INSTALLED),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    (level,) = re.findall(
        r"Overall exposure level for ap-realtime\.service: ([0-9.]+)", result.stdout
    )
    assert float(level) <= 2.0


@functools.cache
def _groups() -> dict[str, list[str]]:
    """Every ``@group`` systemd knows, with its members (syscalls or other groups)."""
    listing = subprocess.run(
        [analyze(), "syscall-filter"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    groups: dict[str, list[str]] = {}
    members: list[str] = []
    for line in listing.splitlines():
        if line.startswith("@"):
            members = groups.setdefault(line.split()[0], [])
        elif line.strip() and not line.strip().startswith("#"):
            members.append(line.strip())
    return groups


def _syscalls(name: str) -> set[str]:
    if not name.startswith("@"):
        return {name}
    return set().union(*(_syscalls(member) for member in _groups()[name]))


def test_the_syscall_filter_lets_serve_raise_its_descriptor_limit() -> None:
    """``serve`` calls setrlimit (glibc: prlimit64) at start; a filtered call would fail it."""
    filters = unit_settings(UNIT.read_text())["Service.SystemCallFilter"]
    allowed = set().union(*(_syscalls(f) for f in filters if not f.startswith("~")))
    denied = set().union(
        *(_syscalls(g) for f in filters if f.startswith("~") for g in f[1:].split())
    )
    assert {"prlimit64", "getrlimit"} <= allowed
    assert not {"prlimit64", "setrlimit", "getrlimit"} & denied


def _seconds(value: str) -> float:
    """A systemd time span of plain seconds, or with one unit (45, 45s, 1min)."""
    match = re.fullmatch(r"([0-9.]+)\s*(s|sec|min|m)?", value)
    assert match is not None, value
    return float(match.group(1)) * (60 if match.group(2) in ("min", "m") else 1)


def test_the_unit_outlasts_the_drain_and_holds_the_connections() -> None:
    unit = unit_settings(UNIT.read_text())
    settings = load(None, env_file())
    whole_drain = (
        settings.drain_seconds
        + settings.drain_move_grace_ms / 1000
        + 2 * settings.presence_debounce
    )
    assert _seconds(one(unit, "Service.TimeoutStopSec")) > whole_drain
    assert one(unit, "Service.KillSignal") == "SIGTERM"
    assert one(unit, "Service.Restart") == "always"
    assert int(one(unit, "Service.LimitNOFILE")) > settings.max_connections + 1000
    assert one(unit, "Service.EnvironmentFile") == "/etc/ap-realtime/ap-realtime.env"
    assert one(unit, "Service.ExecStart").endswith("ap-realtime serve")


def test_the_example_settings_load_and_fit_the_kernel_settings() -> None:
    pairs = env_file()
    known = {"AP_" + name.upper() for name in Settings.__dataclass_fields__}
    assert set(pairs) <= known, set(pairs) - known
    settings = load(None, pairs)  # validates: a bad example raises ConfigError here
    assert settings.clustered and settings.store == "dynamodb"
    sysctls = {}
    for raw in SYSCTL.read_text().splitlines():
        if raw.strip() and not raw.startswith("#"):
            key, _, value = raw.partition("=")
            sysctls[key.strip()] = int(value)
    for key in sysctls:
        assert Path("/proc/sys", *key.split(".")).exists(), key
    assert settings.listen_backlog <= sysctls["net.core.somaxconn"]
    assert settings.listen_backlog <= sysctls["net.ipv4.tcp_max_syn_backlog"]
