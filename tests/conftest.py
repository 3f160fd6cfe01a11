"""Fixtures: a real node on 127.0.0.1 with real sockets, embedded default; the
worker's own Redis; and the tiers and kinds of tests, set by path (docs/testing.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from hypothesis import HealthCheck, settings

from loadtest.harness.faults import TcpFaultProxy
from loadtest.harness.redis_cluster import RedisCluster, redis_cluster_for_tests
from server.app import bound_port, start_listeners
from server.config import Settings
from server.ingress.http_server import HttpListener
from server.node import Node
from server.store.base import Store
from server.store.dynamodb import create_table
from server.wiring import build_node
from tests.client import DEV_SECRET, Client
from tests.services import (
    DynamoFaultProxy,
    RedisServer,
    dynamodb_endpoint_for_tests,
    start_redis_server,
)

PUBLISH_SECRET = "publish-secret-for-tests"
TEST_REGION = "us-east-1"

TEST_SETTINGS = Settings(
    port=0,
    http_port=0,
    node_id="test-node",
    dev_jwt_secret=DEV_SECRET,
    publish_secret=PUBLISH_SECRET,
    presence_debounce_ms=150,
    # A socket that never answers the closing handshake (the flood tests' raw
    # writers) holds the node's stop this long, not the default 5 s.
    close_timeout=1.0,
)


def on_dynamodb(endpoint: str, table: str, **changes: Any) -> Settings:
    """TEST_SETTINGS with ``table`` at ``endpoint`` (moto, or a proxy in front) as the
    store, and ``changes``."""
    return dataclasses.replace(
        TEST_SETTINGS, store="dynamodb", dynamodb_endpoint=endpoint, table=table, **changes
    )


@dataclass
class RunningServer:
    node: Node
    ws_url: str
    http_url: str
    clients: list[Client]
    listener: HttpListener

    async def client(self, **kwargs: Any) -> Client:
        client = await Client.open(self.ws_url, **kwargs)
        self.clients.append(client)
        return client

    async def subscribed(self, user_id: str, **kwargs: Any) -> Client:
        client = await self.client()
        await client.subscribe(user_id, **kwargs)
        return client

    async def http(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        secret: str | None = PUBLISH_SECRET,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any] | str]:
        """One request to the internal HTTP listener, off the event loop."""
        import asyncio

        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        request = urllib.request.Request(self.http_url + path, data=data, method=method)
        if secret is not None:
            request.add_header("Authorization", f"Bearer {secret}")
        for name, value in (headers or {}).items():
            request.add_header(name, value)

        def call() -> tuple[int, dict[str, Any] | str]:
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    status, text = response.status, response.read().decode()
            except urllib.error.HTTPError as error:
                status, text = error.code, error.read().decode()
            try:
                return status, json.loads(text)
            except ValueError:
                return status, text

        return await asyncio.to_thread(call)

    async def publish(self, body: Any, **kwargs: Any) -> tuple[int, dict[str, Any] | str]:
        return await self.http("POST", "/publish", body, **kwargs)


@contextlib.asynccontextmanager
async def run_server(
    settings: Settings, store: Store | None = None
) -> AsyncIterator[RunningServer]:
    node = await build_node(settings, store)
    await node.start()
    ws_server, internal_http = await start_listeners(node)
    http_port = internal_http.port
    running = RunningServer(
        node=node,
        ws_url=f"ws://127.0.0.1:{bound_port(ws_server)}/",
        http_url=f"http://127.0.0.1:{http_port}",
        clients=[],
        listener=internal_http.listener,
    )
    try:
        yield running
    finally:
        for client in running.clients:
            await client.close()
        ws_server.close(close_connections=False)
        await node.stop()
        await ws_server.wait_closed()
        await internal_http.stop()


# Hypothesis fails an example slower than 200 ms, and a strategy slow to draw from,
# by default: both measure the CPU this process got, not the code under test.
settings.register_profile(
    "loaded-machine", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("loaded-machine")

TESTS = Path(__file__).resolve().parent

KIND_BY_PATH = {
    "cluster/": "cluster",
    "browser/": "browser",
    "test_browser.py": "browser",
    "cluster/test_status_page.py": "browser",
    "test_image.py": "image",
}
"""A kind for every test under a directory or in a file, so new files get theirs."""

SLOW = {
    # Whole files: the smoke test's module fixture runs every load-test scenario; the
    # image test builds the image.
    "test_loadtest_smoke.py": 130,
    "test_image.py": 73,
    # Whole files, each with fast kin in the default tier: the browser SDK against
    # node processes (test_browser_sdk.py), the SDKs over a cluster (test_sdk.py),
    # stream epochs (cluster/test_streams.py), Redis Cluster failover and resharding
    # (the contract tests' redis-cluster parameters).
    "test_browser_sdk_nodes.py": 186,
    "cluster/test_sdk_cluster.py": 35,
    "cluster/test_stream_epochs.py": 60,
    "cluster/test_redis_cluster.py": 38,
    # 90 s of faults, then up to 30 s for presence and 30 s for the last events.
    "cluster/test_chaos_soak.py": 145,
    # Single tests (every parameter), by file and name.
    "cluster/test_bots.py::"
    "test_a_bot_on_any_node_gets_its_pending_turns_and_stays_out_of_presence": 7,
    "cluster/test_bot_queue.py::test_a_node_killed_mid_stream_costs_no_turn_and_no_repeat": 29,
    "cluster/test_chat.py::test_concurrent_posts_on_two_nodes_are_stored_once_in_event_order": 12,
    "cluster/test_chat.py::test_last_seen_is_written_once_across_nodes": 7,
    "cluster/test_drain.py::"
    "test_rolling_a_node_moves_its_clients_without_flapping_or_losing_events": 32,
    "cluster/test_failures.py::test_a_paused_node_comes_back": 8,
    "cluster/test_failures.py::test_kill_9_of_a_node_withdraws_its_users_within_the_bound": 10,
    "cluster/test_failures.py::test_leader_failover_keeps_seq_gap_free": 10,
    "cluster/test_failures.py::test_redis_restart_mid_test": 16,
    "cluster/test_notification_push.py::"
    "test_a_handover_after_kill_9_pushes_each_notification_once": 18,
    "cluster/test_presence.py::test_a_quick_move_between_nodes_is_not_a_flap": 6,
    "cluster/test_presence.py::test_one_stream_and_one_state_on_every_node": 8,
    "cluster/test_presence.py::test_the_same_user_on_two_nodes_closing_one_is_not_a_leave": 8,
    "cluster/test_queue_bridge.py::test_a_node_killed_mid_run_loses_and_duplicates_nothing": 13,
    "cluster/test_queue_bridge.py::"
    "test_a_redis_restart_keeps_messages_in_the_queue_until_published": 15,
    "cluster/test_queue_bridge.py::test_competing_consumers_deliver_each_message_once": 7,
    "cluster/test_redis_cluster.py::test_a_whole_cluster_restart": 13,
    "cluster/test_redis_cluster.py::"
    "test_events_cross_nodes_on_every_shard_and_stay_on_their_own": 14,
    "cluster/test_redis_cluster.py::"
    "test_kill_9_of_the_presence_primary_fails_over_without_a_client_gap": 10,
    "cluster/test_redis_cluster.py::"
    "test_the_bridges_dedup_and_lease_ride_through_a_primary_failover": 10,
    "cluster/test_status_page.py::test_the_operators_page_shows_live_numbers_and_every_node": 18,
    "cluster/test_streams.py::test_a_dropped_bus_connection_leaves_no_gap": 19,
    "cluster/test_streams.py::test_history_past_its_ttl_gives_recovered_false": 5,
    "cluster/test_streams.py::test_recovery_on_another_node_while_events_flow": 8,
    "cluster/test_bots.py::test_turns_are_replayed_after_a_bot_reconnects_to_another_node": 19,
    "cluster/test_fanout.py::test_watching_a_new_game_subscribes_its_node": 12,
    "cluster/test_streams.py::test_history_past_its_size_gives_recovered_false": 47,
    "cluster/test_streams.py::test_three_nodes_publishing_concurrently_give_one_order": 51,
    "contract/test_backend_rows_contract.py::test_current_games_follows_pages": 9,
    "cluster/test_shard_pipes.py::test_a_games_legacy_publishes_follow_its_offsets": 10,
    "cluster/test_streams.py::"
    "test_redis_restart_without_data_gives_a_new_epoch_then_live_goes_on": 17,
    "contract/test_store_contract.py::test_list_and_endpoint_delete_read_every_page": 9,
    "contract/test_store_contract.py::test_presence_seq_is_independent_of_connection_rows": 10,
    "contract/test_store_contract.py::test_the_presence_seq_never_goes_down": 10,
    "store/test_dynamodb_schema.py::test_server_errors_are_retried": 10,
    "store/test_dynamodb_schema.py::"
    "test_a_reserve_retried_after_its_answer_was_lost_does_not_skip": 9,
    "test_browser_sdk.py::test_the_sdk_sources_are_formatted": 11,
    "test_notifications.py::test_other_records_are_not_pushed": 11,
    "test_packaging.py::test_the_load_tester_runs_from_a_checkout": 9,
    "test_table_stream.py::test_a_first_start_begins_at_the_latest_record": 10,
    "test_bot_guide.py": 19,
    "test_browser_sdk.py::test_the_sdk_types_check": 15,
    "test_browser_sdk.py::test_a_build_serves_every_run_until_a_source_changes": 35,
    "test_cli.py::test_a_bad_value_is_one_error_and_one_line_of_usage": 16,
    "test_cli.py::test_a_signal_during_start_up_stops_it_at_once_and_leaks_nothing": 13,
    "test_cli.py::test_log_format_json_writes_one_object_per_line_with_the_node_id": 10,
    "test_deploy_aws.py::test_cfn_lint_finds_nothing_with_the_pinned_version": 23,
    "test_deploy_aws.py::test_stack_in_moto": 45,
    "test_dynamodb_node.py::test_create_table_command_makes_the_table_with_ttl": 8,
    "test_dynamodb_node.py::"
    "test_unreachable_dynamodb_at_start_exits_non_zero_with_a_clear_message": 11,
    "test_notifications.py::test_after_a_restart_the_checkpoint_resumes_where_it_stopped": 9,
    "test_protocol.py::test_any_decoded_value_gives_an_action_or_a_clean_error": 25,
    "test_protocol.py::test_any_text_gives_an_action_or_a_clean_error": 46,
    "test_sqs_bridge.py::test_one_message_handed_to_two_pollers_of_one_node_is_published_once": 10,
    "test_stream_shards.py": 12,
    "test_browser.py::test_the_browser_client_works_unchanged": 7,
    "test_chat_dynamodb.py::"
    "test_a_store_outage_answers_unavailable_and_the_retry_is_stored_once": 6,
    "test_sqs_bridge.py::test_sqs_down_then_back_loses_nothing": 7,
    "test_table_stream.py::test_a_restart_resumes_at_the_checkpoint": 11,
    "test_table_stream.py::test_one_reader_at_a_time_and_a_handover_skips_nothing": 18,
}
"""The slow tier, with the most seconds each took (setup, call and teardown): from
two serial runs on the loaded 2-core machine for the older entries, from runs under
4 workers at a load average of 13-20 for the rest. The line is where the rest runs
within 4 minutes with 4 workers; docs/testing.md says how to measure again."""

SLOW_TIMEOUT = 900
"""Seconds a slow test may take before pytest-timeout fails it (others: pyproject's)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.relative_to(TESTS).as_posix()
        for prefix, kind in KIND_BY_PATH.items():
            if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
                item.add_marker(kind)
        test = f"{path}::{item.name.split('[', 1)[0]}"
        if path in SLOW or test in SLOW:
            item.add_marker(pytest.mark.slow)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))


MOTO_READ_TIMEOUT_SECONDS = 60.0


@pytest.fixture(scope="session", autouse=True)
def patient_dynamodb_reads() -> Iterator[None]:
    """In-process stores wait longer for a read than the production 5 s: that bound is
    for DynamoDB, and moto, Python on two loaded cores, takes seconds of CPU for a
    1 MB Query page. Failures are still tested, by the fault proxy's error answers."""
    from server.store import dynamodb

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dynamodb, "READ_TIMEOUT_SECONDS", MOTO_READ_TIMEOUT_SECONDS)
        yield


@pytest.fixture(scope="session")
def worker_redis() -> Iterator[RedisServer]:
    """One ``redis-server`` per xdist worker (per session without xdist)."""
    redis = start_redis_server()
    try:
        yield redis
    finally:
        redis.stop()


@pytest.fixture
def fresh_redis(worker_redis: RedisServer) -> RedisServer:
    """The worker's ``redis-server``, running and empty, for this test alone: it may
    stop or restart it (the next test gets it running again)."""
    if not worker_redis.alive:
        worker_redis.restart()
    worker_redis.flush()
    return worker_redis


@pytest.fixture
async def redis_proxy(fresh_redis: RedisServer) -> AsyncIterator[TcpFaultProxy]:
    """A :class:`TcpFaultProxy` in front of ``fresh_redis``: faults on demand, and
    a record of the round trips through it."""
    proxy = TcpFaultProxy(fresh_redis.port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


@pytest.fixture(scope="session")
def dynamodb_endpoint() -> Iterator[str]:
    """A DynamoDB endpoint: ``AP_TEST_DYNAMODB_ENDPOINT`` or a moto server for the session."""
    with dynamodb_endpoint_for_tests() as endpoint:
        yield endpoint


@pytest.fixture
async def dynamodb_proxy(dynamodb_endpoint: str) -> AsyncIterator[DynamoFaultProxy]:
    """A :class:`DynamoFaultProxy` in front of ``dynamodb_endpoint`` (and its SQS and
    DynamoDB Streams): faults on demand, and a record of the requests through it."""
    proxy = DynamoFaultProxy(dynamodb_endpoint)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


@pytest.fixture(scope="session")
def shared_redis_cluster() -> Iterator[RedisCluster]:
    """One six-instance Redis Cluster for the session's non-destructive tests.

    Tests that kill or restart instances start a cluster of their own.
    """
    with redis_cluster_for_tests() as cluster:
        yield cluster


async def new_table(endpoint: str) -> str:
    """Create a fresh table (TTL on), so DynamoDB tests never see each other's rows."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    await create_table(endpoint, name, TEST_REGION)
    return name


@pytest.fixture
async def table(dynamodb_endpoint: str) -> str:
    return await new_table(dynamodb_endpoint)


@pytest.fixture
def raw(dynamodb_endpoint: str) -> Any:
    """A plain, synchronous boto3 client: reads the table the way the backend does."""
    return boto3.client("dynamodb", endpoint_url=dynamodb_endpoint, region_name=TEST_REGION)


@pytest.fixture
async def server(request: pytest.FixtureRequest) -> AsyncIterator[RunningServer]:
    overrides = getattr(request, "param", {})
    async with run_server(dataclasses.replace(TEST_SETTINGS, **overrides)) as running:
        yield running
