"""lastSeen touches in batches: a connect storm's users go out in chunks of 25, each
one claim round trip and one store request, and a failed chunk is retried alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from server.coordination.claims import MemoryClaims
from server.runtime.metrics import Registry
from server.runtime.pacer import Pacer
from server.services.last_seen import BATCH, LastSeen
from server.store import records as r
from server.store.base import StoreUnavailable
from server.store.memory import MemoryStore


class CountingStore(MemoryStore):
    def __init__(self, failures: int = 0) -> None:
        super().__init__()
        self.calls: list[int] = []
        self.failures = failures

    async def touch_last_seen_many(self, touches: Mapping[str, int]) -> set[str]:
        self.calls.append(len(touches))
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("down for this request")
        return await super().touch_last_seen_many(touches)


class CountingClaims(MemoryClaims):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def claim_many(self, names: Sequence[str], ttl_seconds: float) -> set[str]:
        self.calls += 1
        return await super().claim_many(names, ttl_seconds)


def seeded(store: MemoryStore, users: int) -> list[str]:
    names = [f"u{index}" for index in range(users)]
    for name in names:
        store.put_row(r.USERS_PK, name, {"name": name})
    return names


async def test_a_storm_of_users_goes_out_in_chunks() -> None:
    store, claims, metrics = CountingStore(), CountingClaims(), Registry()
    last_seen = LastSeen(store, claims, metrics, Pacer())
    names = seeded(store, 60)
    last_seen.start()
    try:
        for name in names:  # queued before the flusher runs: one batch
            last_seen.seen(name)
        await last_seen.drained()
    finally:
        await last_seen.close()
    assert store.calls == [BATCH, BATCH, 60 - 2 * BATCH]
    assert claims.calls == 3
    assert metrics.value("ap_last_seen_requests_total") == 3
    assert metrics.value("ap_last_seen_writes_total") == 60
    assert all(isinstance(store.get_row(r.USERS_PK, n)[r.LAST_SEEN], int) for n in names)  # type: ignore[index]


async def test_a_failed_chunk_is_retried_without_claiming_again() -> None:
    store, claims = CountingStore(failures=1), CountingClaims()
    last_seen = LastSeen(store, claims, Registry(), Pacer())
    names = seeded(store, 30)
    last_seen.start()
    try:
        for name in names:
            last_seen.seen(name)
        await last_seen.drained()
    finally:
        await last_seen.close()
    # the first chunk failed and came back with its claims held: no claim round trip
    assert store.calls == [BATCH, 30 - BATCH, BATCH]
    assert claims.calls == 2
    assert all(r.LAST_SEEN in (store.get_row(r.USERS_PK, n) or {}) for n in names)
