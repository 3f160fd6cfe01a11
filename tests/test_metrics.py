"""Each node owns its metrics: two nodes in one process never share or overwrite them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from tests.client import Client
from tests.conftest import TEST_SETTINGS, RunningServer, run_server
from tests.services import redis_url_for_tests


async def scrape(server: RunningServer) -> dict[str, float]:
    status, text = await server.http("GET", "/metrics", secret=None)
    assert status == 200 and isinstance(text, str)
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


async def sees(client: Client, users: set[str]) -> None:
    await client.wait_for(lambda: client.presence.visible == users)


async def test_two_nodes_in_one_process_each_show_their_own_connections_and_counters() -> None:
    async with (
        run_server(dataclasses.replace(TEST_SETTINGS, node_id="one")) as one,
        run_server(dataclasses.replace(TEST_SETTINGS, node_id="two")) as two,
    ):
        assert one.node.metrics is not two.node.metrics
        watcher = await one.subscribed("alice", games=[("chess", "g1")])
        await one.subscribed("bob")
        await two.subscribed("carol")
        # Presence settled (no delta still to come), so what each node sent is final.
        for server, users in ((one, {"alice", "bob"}), (two, {"carol"})):
            for client in server.clients:
                await sees(client, users)
        status, _ = await one.publish({"verb": "game", "payload": {"meta": "chess", "id": "g1"}})
        assert status == 202
        await watcher.next_message(lambda m: m.get("verb") == "game", within=10)
        first, second = await scrape(one), await scrape(two)
        # Gauges: each node's own sessions (the second node's did not replace the first's).
        assert (first["ap_connections"], second["ap_connections"]) == (2, 1)
        assert (first["ap_users"], second["ap_users"]) == (2, 1)
        assert (first["ap_watched_games"], second["ap_watched_games"]) == (1, 0)
        # Counters: the event was published on, and delivered by, the first node only.
        assert (first["ap_events_published_total"], second["ap_events_published_total"]) == (1, 0)
        assert first["ap_frames_sent_total"] > second["ap_frames_sent_total"] > 0
        # Each node's frames, exactly: what its own clients received.
        for server in (one, two):
            for client in server.clients:
                await client.barrier()
        first, second = await scrape(one), await scrape(two)
        assert first["ap_frames_sent_total"] == sum(c.frames_received for c in one.clients)
        assert second["ap_frames_sent_total"] == sum(c.frames_received for c in two.clients)
        # /status reads the same registry.
        _, body = await one.http("GET", "/status", secret=None)
        assert isinstance(body, dict) and body["events"]["published"] == 1
        _, body = await two.http("GET", "/status", secret=None)
        assert isinstance(body, dict) and body["events"]["published"] == 0


async def test_every_part_of_a_node_counts_on_its_registry() -> None:
    """What wiring builds registers on the node's registry, process readings included."""
    async with run_server(TEST_SETTINGS) as server:
        names = set(await scrape(server))
    assert {
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "ap_connections",
        "ap_events_published_total",
        "ap_frames_sent_total",
        "ap_frames_received_total",
        "ap_flood_closes_total",
        "ap_client_errors_total",
        "ap_refused_upgrades_total",
        "ap_store_write_backlog",
        "ap_store_write_retries_total",
        "ap_presence_deltas_total",
        "ap_presence_view_reloads_total",
        "ap_stream_history_batches_total",
        "ap_stream_history_bytes",
        "ap_chat_comments_stored_total",
        "ap_chat_batches_total",
        "ap_chat_access_reads_total",
        "ap_chat_access_cached_total",
        "ap_chat_batch_store_seconds_total",
        "ap_chat_mark_backlog",
        "ap_game_lock_timeouts_total",
        "ap_last_seen_writes_total",
        "ap_bot_refusals_total",
        "ap_token_cache_hits_total",
    } <= names


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_url_for_tests() as url:
        yield url


async def test_two_cluster_nodes_in_one_process_each_report_their_own_bus(redis_url: str) -> None:
    """The bus's gauge was the last bus's for every node; now each reads its own."""
    async with (
        run_server(dataclasses.replace(TEST_SETTINGS, node_id="one", redis_url=redis_url)) as one,
        run_server(dataclasses.replace(TEST_SETTINGS, node_id="two", redis_url=redis_url)) as two,
    ):
        first, second = await scrape(one), await scrape(two)
        assert first["ap_bus_connected"] == second["ap_bus_connected"] == 1
        assert "ap_presence_commits_refused_total" in first
        await two.node.bus.close()
        first, second = await scrape(one), await scrape(two)
        assert (first["ap_bus_connected"], second["ap_bus_connected"]) == (1, 0)
