"""The history-read benchmark runs, on a real redis-server, and reports per read."""

from __future__ import annotations

import pytest

from loadtest.scenarios.history_read import main, run


async def test_the_benchmark_reads_every_stream_and_reports_per_read() -> None:
    figures = await run(streams_count=20, events=3, batches=5, rounds=2)
    assert figures["streams_per_batch"] == 20
    assert figures["events_read_per_stream"] == 2
    assert len(figures["cpu_us_per_read"]) == len(figures["wall_us_per_read"]) == 2
    assert all(us > 0 for us in figures["cpu_us_per_read"] + figures["wall_us_per_read"])


def test_the_command_line_refuses_an_empty_run() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--streams", "0"])
    assert exit_info.value.code == 2
