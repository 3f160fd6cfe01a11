"""The stream audit's cost benchmark runs, on a real redis-server, and reports per stream."""

from __future__ import annotations

import pytest

from loadtest.scenarios.stream_audit import main, run


async def test_the_benchmark_times_full_audits_of_streams_in_step() -> None:
    figures = await run(count=300, rounds=2)  # two batches and a part
    assert figures["held_streams"] == 300
    assert len(figures["node_cpu_us_per_stream"]) == 2
    assert all(us > 0 for us in figures["node_cpu_us_per_stream"])
    assert all(ms > 0 for ms in figures["audit_wall_ms"])
    assert figures["node_core_share_at_30s"] > 0


def test_the_command_line_refuses_an_empty_run() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--streams", "0"])
    assert exit_info.value.code == 2
