"""The reclaimer collects the young generations only while that is a short pause."""

from __future__ import annotations

import gc
from typing import Any

from server.runtime.reclaim import YOUNG_OBJECTS_COLLECTED, Reclaimer


def test_reclaim_collects_small_young_generations_and_leaves_large_ones() -> None:
    started: list[int] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.collect()
    gc.disable()  # only the reclaimer's own collections
    gc.callbacks.append(on_gc)
    try:
        reclaimer = Reclaimer()
        reclaimer.reclaim()
        assert started == [1]
        started.clear()
        young = [[i] for i in range(YOUNG_OBJECTS_COLLECTED + 1000)]  # a connect wave's worth
        reclaimer.reclaim()
        assert started == []
        assert reclaimer.closes == 0
        del young
    finally:
        gc.callbacks.remove(on_gc)
        gc.enable()
