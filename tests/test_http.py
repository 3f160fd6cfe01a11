"""The internal HTTP listener: health, readiness, metrics."""

from __future__ import annotations

import asyncio

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


async def test_metrics_use_the_prometheus_content_type_and_types() -> None:
    from server.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
    from server.runtime.metrics import Registry, register_process

    assert METRICS_CONTENT_TYPE.startswith("text/plain; version=0.0.4")
    registry = Registry()
    register_process(registry)
    text = registry.render()
    assert "# TYPE process_cpu_seconds_total counter" in text
    assert "# TYPE process_resident_memory_bytes gauge" in text


async def test_metrics_are_served_with_the_exposition_content_type(server: RunningServer) -> None:
    import urllib.request

    def head() -> str:
        with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as response:
            return str(response.headers["Content-Type"])

    assert await asyncio.to_thread(head) == "text/plain; version=0.0.4; charset=utf-8"


async def test_status_shows_what_metrics_show(server: RunningServer) -> None:
    alice = await server.subscribed("alice", games=[("chess", "g1")])
    await server.subscribed("alice", games=[("chess", "g2")])
    await server.subscribed("bob")
    # Both joins committed (seq moved), so /status and /metrics read the same seq.
    await alice.wait_for(lambda: alice.presence.visible == {"alice", "bob"})
    status, body = await server.http("GET", "/status", secret=None)
    assert status == 200 and isinstance(body, dict)
    _, text = await server.http("GET", "/metrics", secret=None)
    assert isinstance(text, str)
    values = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert body["connections"] == int(values["ap_connections"]) == 3
    assert body["users"] == int(values["ap_users"]) == 2
    assert body["watched_games"] == int(values["ap_watched_games"]) == 2
    assert body["presence"]["seq"] == int(values["ap_presence_seq"])
    assert body["presence"]["writer"] is True and body["bus"]["connected"] is True
    assert body["closes"]["slow_consumer"] == float(values["ap_slow_consumers_total"])
    assert body["nodes"] == [
        {"node_id": "test-node", "heartbeat_age_ms": 0, "users": 2, "writer": True}
    ]
    assert set(body["history"]) == {"interval_s", "t", "connections", "events_per_s"}


async def test_the_operators_page_is_one_self_contained_file(server: RunningServer) -> None:
    status, page = await server.http("GET", "/", secret=None)
    assert status == 200 and isinstance(page, str)
    assert page.startswith("<!doctype html>") and 'fetch("status"' in page
    assert "http://" not in page and "https://" not in page  # nothing from a CDN
