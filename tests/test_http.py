"""The internal HTTP listener: health, readiness, metrics."""

from __future__ import annotations

from tests.conftest import RunningServer


async def test_healthz_names_the_node(server: RunningServer) -> None:
    assert await server.http("GET", "/healthz", secret=None) == (
        200,
        {"status": "ok", "node": "test-node"},
    )


async def test_readyz_is_ready_once_started(server: RunningServer) -> None:
    status, body = await server.http("GET", "/readyz", secret=None)
    assert status == 200
    assert body == {"ready": True, "started": True, "bus": True}


async def test_readyz_says_so_when_the_bus_is_down(server: RunningServer) -> None:
    await server.node.bus.close()
    status, body = await server.http("GET", "/readyz", secret=None)
    assert status == 503
    assert isinstance(body, dict) and body["bus"] is False and body["ready"] is False


async def test_metrics_count_connections_and_frames(server: RunningServer) -> None:
    await server.subscribed("alice", games=[("chess", "g1")])
    await server.subscribed("bob")
    status, text = await server.http("GET", "/metrics", secret=None)
    assert status == 200 and isinstance(text, str)
    values = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert values["ap_connections"] == "2"
    assert values["ap_users"] == "2"
    assert values["ap_watched_games"] == "1"
    assert float(values["ap_frames_sent_total"]) >= 2
    assert float(values["process_resident_memory_bytes"]) > 1_000_000
    assert "# TYPE ap_slow_consumers_total counter" in text


async def test_unknown_paths_are_404(server: RunningServer) -> None:
    assert (await server.http("GET", "/publish", secret=None))[0] == 405
    assert (await server.http("GET", "/nope", secret=None))[0] == 404
