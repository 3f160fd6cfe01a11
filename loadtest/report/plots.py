"""``--report DIR``: a markdown report with PNG plots (matplotlib, no display needed).

Plots: the latency distribution (CDF, log scale), throughput over time, and
server memory against connections, each with our server beside the baseline
when the run measured both.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import itertools

import matplotlib.pyplot as plt

from loadtest.report.summary import figure_rows
from loadtest.report.targets import format_value

COLORS = {
    "baseline": "tab:gray",
    "ours": "tab:blue",
    "cluster": "tab:green",
    "ours+redis": "tab:purple",
}


def write_report(result: dict[str, Any], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    plots: list[tuple[str, str]] = []
    over_time = "Throughput over time"
    if _presence_parts(result):
        over_time = "Delta latency over time (each churn action)"
    elif result["scenario"] in ("idle", "storm", "recovery"):
        over_time = "Subscribed clients over time"
    for name, title, draw in (
        ("latency.png", "Latency distribution", _latency),
        ("throughput.png", over_time, _throughput),
        ("memory.png", "Server memory against connections", _memory),
    ):
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        try:
            drawn = draw(result, ax)
            if drawn:
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(loc="best", fontsize=8)
                fig.tight_layout()
                fig.savefig(directory / name)
                plots.append((name, title))
        finally:
            plt.close(fig)
    path = directory / "report.md"
    path.write_text(_markdown(result, plots))
    return path


# --- plots --------------------------------------------------------------------


def _fanout_parts(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    parts: list[tuple[str, dict[str, Any]]] = []
    for name, figs in result["figures"]["servers"].items():
        if name == "cluster":
            parts.append((f"cluster ({figs['nodes']} nodes)", figs["fanout"]))
        elif "saturate" in figs:
            parts.append((name, figs))
    return parts


def _presence_parts(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    parts: list[tuple[str, dict[str, Any]]] = []
    for name, figs in result["figures"]["servers"].items():
        if name == "cluster":
            parts.append((f"cluster ({figs['nodes']} nodes)", figs["presence"]))
        elif "all_observers_ms" in figs:
            parts.append((name, figs))
    return parts


def _color(label: str) -> str:
    return COLORS.get(label.split(" ")[0], "tab:orange")


def _latency(result: dict[str, Any], ax: Any) -> bool:
    drawn = False
    for label, figs in _fanout_parts(result):
        cdf = figs["steady"].get("latency_cdf_ms") or []
        if cdf:
            xs, ys = zip(*cdf, strict=True)
            rate = figs["steady"].get("target_rate", 0)
            ax.step(xs, ys, where="post", color=_color(label), label=f"{label}, {rate:.0f} pub/s")
            drawn = True
        sat = figs["saturate"].get("latency_cdf_ms") or []
        if sat:
            xs, ys = zip(*sat, strict=True)
            ax.step(
                xs,
                ys,
                where="post",
                color=_color(label),
                linestyle=":",
                label=f"{label}, saturated",
            )
            drawn = True
    if drawn:
        limit = 20 if result["scenario"] == "publish" else 50
        ax.axvline(
            limit, color="tab:red", linestyle="--", linewidth=1, label=f"target p99 {limit} ms"
        )
        ax.set_xlabel("publish to receive latency (ms, log)")
    for label, figs in _presence_parts(result):
        limit = figs["debounce_ms"] + 100
        for key, style, what in (
            ("pairs_cdf_ms", "-", "each observer"),
            ("all_observers_cdf_ms", "--", "all observers"),
        ):
            cdf = figs.get(key) or []
            if cdf:
                xs, ys = zip(*cdf, strict=True)
                ax.plot(xs, ys, linestyle=style, color=_color(label), label=f"{label}: {what}")
                drawn = True
        ax.axvline(limit, color="tab:red", linestyle="--", linewidth=1, label=f"target {limit} ms")
        ax.set_xlabel("churn action to delta received (ms, log)")
    for name, figs in result["figures"]["servers"].items():
        for key, what in (
            ("subscribed_cdf_s", "the client's snapshot"),
            ("recovered_cdf_s", "the client's last recovered answer"),
        ):
            cdf = figs.get(key) or []
            if cdf:
                xs, ys = zip(*cdf, strict=True)
                ax.step(xs, ys, where="post", color=_color(name), label=name)
                ax.set_xlabel(f"time from the storm's start to {what} (s)")
                drawn = True
    if drawn:
        storms = ("subscribed_cdf_s", "recovered_cdf_s")
        if not any(
            figs.get(key) for figs in result["figures"]["servers"].values() for key in storms
        ):
            ax.set_xscale("log")
        else:
            ax.axvline(10, color="tab:red", linestyle="--", linewidth=1, label="target 10 s")
        ax.set_ylabel("fraction")
        ax.set_ylim(0, 1.01)
    return drawn


def _segments(series: list[dict[str, Any]], stages: set[str]) -> dict[str, list[dict[str, Any]]]:
    """Consecutive samples per server while it was driven in one of ``stages``."""
    by_server: dict[str, list[dict[str, Any]]] = {}
    for sample in series:
        if sample["active"] and sample["stage"] in stages:
            by_server.setdefault(sample["active"], []).append(sample)
    return by_server


def _rates(samples: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    points: list[tuple[float, float]] = []
    for before, after in itertools.pairwise(samples):
        dt = after["t"] - before["t"]
        if 0 < dt < 1.0:  # consecutive samples only
            points.append((after["t"], max(0.0, (after[key] - before[key]) / dt)))
    return points


def _throughput(result: dict[str, Any], ax: Any) -> bool:
    scenario = result["scenario"]
    drawn = False
    series = result["series"]
    if scenario in ("fanout", "baseline", "cluster"):
        key, what, stages = (
            "game_events",
            "game events delivered/s",
            {"saturate", "steady", "drain"},
        )
        ax.set_ylabel("messages per second")
    elif scenario == "presence":
        return _presence_timeline(result, ax)
    else:
        key, what, stages = (
            "subscribed_active",
            "subscribed clients",
            {"connect", "settle", "storm"},
        )
        ax.set_ylabel("subscribed clients")
    for server, samples in _segments(series, stages).items():
        if key == "subscribed_active":
            points = [(s["t"], float(s[key])) for s in samples]
        else:
            points = _rates(samples, key)
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, ".", markersize=3, color=_color(server), label=f"{server}: {what}")
        drawn = True
    ax.set_xlabel("seconds since the run started")
    return drawn


def _presence_timeline(result: dict[str, Any], ax: Any) -> bool:
    """Each churn action's latency to its first and last observer, against its time."""
    drawn = False
    for label, figs in _presence_parts(result):
        actions = figs.get("per_action") or []
        if not actions:
            continue
        xs = [a["t_s"] for a in actions]
        ax.plot(
            xs,
            [a["all_ms"] for a in actions],
            ".",
            markersize=4,
            color=_color(label),
            label=f"{label}: to all observers",
        )
        ax.plot(
            xs,
            [a["first_ms"] for a in actions],
            ".",
            markersize=2,
            color="tab:orange",
            label=f"{label}: to the first observer",
        )
        limit = figs["debounce_ms"] + 100
        ax.axhline(limit, color="tab:red", linestyle="--", linewidth=1, label=f"{limit} ms")
        drawn = True
    ax.set_xlabel("seconds since the first churn action")
    ax.set_ylabel("latency (ms)")
    return drawn


def _memory(result: dict[str, Any], ax: Any) -> bool:
    drawn = False
    for server, samples in _segments(result["series"], {"connect", "settle"}).items():
        points = [
            (s["subscribed_active"], s["rss_bytes"][server] / 2**20)
            for s in samples
            if s["rss_bytes"].get(server)
        ]
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, ".", markersize=4, color=_color(server), label=server)
        drawn = True
    ax.set_xlabel("subscribed connections")
    ax.set_ylabel("server RSS (MiB)")
    return drawn


# --- markdown -----------------------------------------------------------------


def _pinning(result: dict[str, Any]) -> str:
    pinning = result.get("pinning") or {}
    if not pinning.get("server_cpus"):
        return "- CPU pinning: none (servers and generator share every CPU)"
    return (
        f"- CPU pinning: servers under test on CPUs {pinning['server_cpus']}, "
        f"generator on CPUs {pinning['generator_cpus']}"
    )


def _markdown(result: dict[str, Any], plots: list[tuple[str, str]]) -> str:
    figures = result["figures"]
    machine = result["machine"]
    gen = result["generator"]
    lines = [
        f"# Load test: `{result['scenario']}`",
        "",
        f"- Date: {result['date']}",
        f"- Command: `{' '.join(result['command'])}`",
        f"- Machine: {machine['cpus']} CPUs ({machine['cpu_model']}), "
        f"{machine['memory_gib']} GiB, Linux {machine['kernel']}, Python {machine['python']}",
        f"- Generator: {result['options']['workers']} worker processes (uvloop); "
        f"{gen['generator_cpu_s']:.1f} CPU-s over {gen['wall_s']:.1f} s "
        f"({gen['generator_cores']:.2f} cores on average, busiest process "
        f"{gen['generator_busiest_process']:.2f} of a core)",
        _pinning(result),
        "",
    ]
    targets = figures.get("targets", [])
    if targets:
        lines += [
            "## Targets",
            "",
            "| Target | Limit | Measured | Verdict | Note |",
            "|---|---|---|---|---|",
        ]
        for t in targets:
            limit = format_value(t["limit"], t["unit"])
            measured = format_value(t["value"], t["unit"])
            lines.append(
                f"| {t['scenario']}: {t['figure']} | {t['op']} {limit}"
                f" | {measured} | **{t['verdict']}** | {t['note']} |"
            )
        lines.append("")
    ratios: dict[str, float] = figures.get("ratios", {})
    if ratios:
        lines += [
            "## Ours beside the baseline",
            "",
            "Ratios are ours / baseline, both measured by the same generator in this run.",
            "",
            "| Figure | Ratio |",
            "|---|---|",
        ]
        for name, rel in ratios.items():
            shown = "n/a" if isinstance(rel, float) and math.isnan(rel) else f"{rel:.3f}"
            lines.append(f"| {name.replace('_', ' ')} | {shown} |")
        lines.append("")
    lines += ["## Figures", "", "| Server | Figure | Value |", "|---|---|---|"]
    for server, figure, value in figure_rows(result):
        lines.append(f"| {server} | {figure} | {value} |")
    lines.append("")
    if plots:
        lines += ["## Plots", ""]
        for name, title in plots:
            lines += [f"### {title}", "", f"![{title}]({name})", ""]
    lines += [
        "## Method",
        "",
        "- Server CPU is the CPU time the kernel charged to the server process(es) "
        "(`utime + stime` in `/proc/PID/stat`) over the measured interval, for ours and the "
        "baseline alike; RSS is `VmRSS`. Per-connection RSS is (RSS with N subscribed - RSS "
        "before connecting) / N.",
        "- Latency is from the timestamp in the published payload (the scheduled send time at a "
        "fixed rate) to the moment the client read the frame.",
        "- The full figures are in the JSON written with `--json`.",
        "",
    ]
    return "\n".join(lines)
