"""The pacer lets background writes go when the process has CPU to spare, and at the
latest after its bound: counted on injected clocks, never on wall time; and the
demand it measures is the kernel's (run time and wait for a CPU) where there is one."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from server.runtime.pacer import Pacer, demand_clock, schedstat_demand


class FakeProcess:
    """A wall clock, a demand clock (ran or waited for a CPU) and a run clock; the
    process wants a CPU ``share`` of the time through ``busy_probes`` probes, and
    gets ``got`` of what it wants (1: a CPU to itself)."""

    def __init__(self, busy_probes: int, share: float = 0.9, got: float = 1.0) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.ran = 0.0
        self.busy_probes = busy_probes
        self.share = share
        self.got = got
        self.probes = 0

    async def sleep(self, seconds: float) -> None:
        self.probes += 1
        self.wall += seconds
        if self.probes <= self.busy_probes:
            self.cpu += seconds * self.share  # other work ran meanwhile
            self.ran += seconds * self.share * self.got


def pacer_on(process: FakeProcess, max_wait_s: float = 1.0, max_wall_s: float = 5.0) -> Pacer:
    return Pacer(
        busy_share=0.6,
        poll_s=0.02,
        max_wait_s=max_wait_s,
        max_wall_s=max_wall_s,
        clock=lambda: process.wall,
        cpu_clock=lambda: process.cpu,
        run_clock=lambda: process.ran,
        sleep=process.sleep,
    )


async def test_a_quiet_process_gives_the_turn_after_one_probe() -> None:
    process = FakeProcess(busy_probes=0)
    pacer = pacer_on(process)
    await pacer.turn()
    assert (process.probes, pacer.waits, pacer.forced) == (1, 0, 0)


async def test_a_busy_process_is_waited_out_until_it_has_cpu_to_spare() -> None:
    process = FakeProcess(busy_probes=3)
    pacer = pacer_on(process)
    await pacer.turn()
    assert process.probes == 4 and pacer.waits == 3 and pacer.forced == 0


async def test_a_share_at_the_threshold_is_not_busy() -> None:
    process = FakeProcess(busy_probes=5, share=0.5)
    pacer = pacer_on(process)
    await pacer.turn()
    assert process.probes == 1 and pacer.waits == 0


async def test_a_process_that_stays_busy_does_not_starve_the_writes() -> None:
    process = FakeProcess(busy_probes=10**9, share=1.0)
    pacer = pacer_on(process, max_wait_s=0.5)
    await pacer.turn()
    assert pacer.forced == 1
    assert 0.5 <= process.wall < 0.5 + 0.02 + 1e-9  # the bound, give or take one probe
    await pacer.turn()
    assert pacer.forced == 2


async def test_writers_sharing_a_pacer_get_one_forced_turn_per_bound_together() -> None:
    # Under a load that never lets up, two writers are not two forced batches a
    # second: the second's wait begins when the first has had its turn.
    process = FakeProcess(busy_probes=10**9, share=1.0)
    pacer = pacer_on(process, max_wait_s=0.5)
    order: list[str] = []

    async def writer(name: str) -> None:
        await pacer.turn()
        order.append(name)

    await asyncio.gather(writer("rows"), writer("lastSeen"))
    assert order == ["rows", "lastSeen"] and pacer.forced == 2
    assert 1.0 <= process.wall < 1.0 + 2 * 0.02 + 1e-9


async def test_the_bound_is_the_node_s_cpu_time_not_the_wall_s() -> None:
    # On a shared machine the node gets a quarter of what it wants: a forced
    # write waits for as much of the node's own work as with a CPU to itself,
    # so forced writes keep the same share of that work.
    process = FakeProcess(busy_probes=10**9, share=1.0, got=0.25)
    pacer = pacer_on(process, max_wait_s=0.5)
    await pacer.turn()
    assert pacer.forced == 1
    assert 0.5 <= process.ran < 0.5 + 0.02 + 1e-9
    assert 2.0 <= process.wall < 2.0 + 4 * 0.02 + 1e-9


async def test_a_node_that_gets_almost_no_cpu_still_writes_at_the_wall_bound() -> None:
    process = FakeProcess(busy_probes=10**9, share=1.0, got=0.01)
    pacer = pacer_on(process, max_wait_s=0.5, max_wall_s=3.0)
    await pacer.turn()
    assert pacer.forced == 1 and process.ran < 0.5
    assert 3.0 <= process.wall < 3.0 + 0.02 + 1e-9


def test_demand_counts_the_time_the_thread_ran() -> None:
    # The kernel's own figure for this thread: what it ran, plus what it waited
    # for a CPU (0 or more, depending on the machine's load).
    ran_before, demand_before = time.thread_time(), schedstat_demand()
    deadline = ran_before + 0.05
    while time.thread_time() < deadline:
        pass
    ran = time.thread_time() - ran_before
    assert schedstat_demand() - demand_before >= ran - 0.002


def test_demand_is_the_run_time_plus_the_wait_for_a_cpu(tmp_path: Path) -> None:
    stat = tmp_path / "schedstat"
    stat.write_text("300000000 200000000 17\n")
    assert schedstat_demand(str(stat)) == 0.5
    clock = demand_clock(str(stat))
    assert clock() == 0.5
    stat.write_text("400000000 200000000 18\n")  # read again through the kept descriptor
    assert clock() == 0.6


def test_without_schedstat_the_demand_is_the_process_cpu_time(tmp_path: Path) -> None:
    assert demand_clock(str(tmp_path / "missing")) is time.process_time
