"""loadtest/README.md's results table is what the committed JSON results make of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.report import table
from loadtest.report.summary import figure_rows

RUN = {
    "scenario": "storm",
    "date": "2026-12-01T19:30:05+00:00",
    "command": ["python", "-m", "loadtest", "storm", "-n", "200", "--json", "x.json"],
    "options": {"connections": 200, "games": 0},
    "load_average": {"start": [3.25, 2.0, 1.0], "end": [7.5, 3.0, 1.5]},
    "figures": {
        "targets": [
            {
                "scenario": "storm",
                "figure": "time until every client is subscribed with a snapshot",
                "unit": "s",
                "op": "<=",
                "limit": 10.0,
                "value": 1.5,
                "verdict": "pass",
                "note": "run at 200 clients; the target is set at 10000",
            },
            {
                "scenario": "storm",
                "figure": "failed connects",
                "unit": "",
                "op": "<=",
                "limit": 0,
                "value": None,  # NaN in the run, null in its JSON
                "verdict": "short",
                "note": "",
            },
        ]
    },
}

CHAOS_RUN = {
    "topology": "redis",
    "seed": 3,
    "clients": 300,
    "minutes": 10.0,
    "lost": 0,
    "duplicated": 1,
    "out_of_order": 0,
    "unannounced_gaps": 0,
    "conflicts": 0,
    "presence_converged_s": 0.0,
    "crashed": [],
    "date": "2026-12-01T18:00:00+00:00",
    "command": ["python", "-m", "loadtest", "chaos", "--seed", "3"],
}


def test_the_readme_table_is_generated_from_the_committed_results() -> None:
    readme = table.README.read_text()
    wanted = table.rewrite(readme, table.render(table.load_results()))
    assert readme == wanted, "loadtest/README.md is stale: run python -m loadtest table"
    assert table.main(["--check"]) == 0


def test_the_readme_is_at_most_150_lines() -> None:
    lines = table.README.read_text().splitlines()
    assert len(lines) <= 150, f"loadtest/README.md has {len(lines)} lines"


def test_every_committed_result_has_a_row_and_its_command() -> None:
    block = table.render(table.load_results())
    for name, run in table.load_results():
        assert f"`{name}`" in block
        assert " ".join(run["command"]) in block


def test_a_row_shows_figure_target_verdict_size_date_and_the_command() -> None:
    block = table.render([("storm.json", RUN)])
    rows = block.splitlines()
    assert (
        "| storm | time until every client is subscribed with a snapshot | 1.5 s | ≤ 10 s "
        "| **pass** (run at 200 clients; the target is set at 10000) | 200 conn "
        "| 2026-12-01 19:30 UTC |"
    ) in rows
    # a figure that could not be measured is n/a and short
    assert (
        "| storm | failed connects | n/a | ≤ 0 | **short** | 200 conn | 2026-12-01 19:30 UTC |"
    ) in rows
    assert (
        "- `storm.json` (2026-12-01 19:30 UTC, load average 3.2 at the start, 7.5 at the end): "
        "`python -m loadtest storm -n 200 --json x.json`" in rows
    )


def test_a_chaos_file_gives_one_row_per_topology() -> None:
    block = table.render([("chaos.json", CHAOS_RUN)])
    row = next(r for r in block.splitlines() if r.startswith("| chaos"))
    assert "| chaos (redis, seed 3) |" in row
    assert "| 0 / 1 / 0 / 0 / 0 | all 0 | **short** |" in row


def test_check_fails_on_a_stale_readme_and_a_rewrite_fixes_it(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "storm.json").write_text(json.dumps(RUN))
    (results / "chaos.json").write_text(json.dumps([CHAOS_RUN]))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{table.BEGIN}\nold figures\n{table.END}\n\nafter\n")
    args = ["--results", str(results), "--readme", str(readme)]
    assert table.main([*args, "--check"]) == 1
    assert table.main(args) == 0
    text = readme.read_text()
    assert "old figures" not in text
    assert text.startswith("# x\n\n") and text.endswith(f"{table.END}\n\nafter\n")
    assert "| chaos (redis, seed 3) |" in text and "| storm | failed connects |" in text
    assert table.main([*args, "--check"]) == 0


def test_a_readme_without_the_markers_or_a_run_without_its_command_is_refused(
    tmp_path: Path,
) -> None:
    with pytest.raises(table.TableError):
        table.rewrite("# no markers\n", "block")
    (tmp_path / "bad.json").write_text(json.dumps({"scenario": "idle", "date": "2026-12-01"}))
    with pytest.raises(table.TableError, match="command"):
        table.load_results(tmp_path)


def test_a_run_without_targets_shows_its_headline_figures_without_a_verdict() -> None:
    run = {
        "scenario": "streammem",
        "date": "2026-12-01T19:40:00+00:00",
        "command": ["python", "-m", "loadtest", "streammem"],
        "options": {"connections": 10000},
        "figures": {"servers": {"ours": {"rss_per_connection_kib": 19.9}}, "targets": []},
    }
    rows = table.render([("streammem.json", run)]).splitlines()
    assert (
        "| streammem | RSS per connection | 19.9 KiB | - | - | 10,000 conn | 2026-12-01 19:40 UTC |"
    ) in rows


def test_a_run_without_targets_shows_at_most_five_figures() -> None:
    figs: dict[str, Any] = {"rss_per_connection_kib": 19.9, "time_to_all_subscribed_s": 1.5}
    figs |= {"time_to_subscribed_s": {"p50_s": 0.5, "p99_s": 1.2}, "subscribed": 10}
    figs |= {"clients": 10, "failed_connects": 0, "generator_cores": 0.4}
    run = {
        "scenario": "baseline",
        "date": "2026-12-01T19:40:00+00:00",
        "command": ["python", "-m", "loadtest", "baseline"],
        "figures": {"servers": {"baseline": figs}, "targets": []},
    }
    rows = [r for r in table.render([("baseline.json", run)]).splitlines() if "| baseline |" in r]
    more = len(figure_rows(run)) - 5
    assert more > 0 and len(rows) == 5
    assert rows[-1].endswith(
        f"| - | {more} more figures in baseline.json | - | 2026-12-01 19:40 UTC |"
    )
