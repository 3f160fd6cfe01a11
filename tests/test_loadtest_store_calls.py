"""The store-calls benchmark runs against a moto server of its own and reports per call."""

from __future__ import annotations

import pytest

from loadtest.harness.servers import FAKE_AWS
from loadtest.scenarios.store_calls import main, run


async def test_the_benchmark_makes_every_call_and_reports_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in FAKE_AWS.items():  # the run sets them: undone after the test
        monkeypatch.setenv(name, value)
    figures = await run(calls=40, concurrency=3, rounds=2)
    per_call = figures["cpu_us_per_call"]
    # Every caller makes as many calls as the others: 39 of the 40 asked, and 6 of
    # the 8 batch calls; the figures are per call made.
    assert figures["calls_per_round"] == {
        "UpdateItem (lastSeen, written)": 39,
        "lastSeen of 25 users (BatchGetItem + BatchExecuteStatement)": 6,
        "BatchWriteItem (25 wsConnections rows)": 6,
        "GetItem": 39,
    }
    assert set(per_call) == set(figures["calls_per_round"])
    assert all(len(rounds) == 2 and min(rounds) > 0 for rounds in per_call.values())


@pytest.mark.parametrize("argv", [["--calls", "10"], ["--rounds", "0"], ["--concurrency", "0"]])
def test_the_command_line_refuses_a_run_that_cannot_measure(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
