"""The internal HTTP listener: health, readiness, metrics."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import PUBLISH_SECRET, RunningServer
from tests.waiting import eventually


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


# --- the listener itself: keep-alive, pipelining, framing, refusals ------------------


async def _exchange(
    server: RunningServer, data: bytes, answers: int
) -> list[tuple[int, bytes, bytes]]:
    """Write ``data`` on one connection; read ``answers`` responses (status, head, body)."""
    port = int(server.http_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = []
    try:
        writer.write(data)
        for _ in range(answers):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            body = b"" if data.startswith(b"HEAD") else await reader.readexactly(length)
            out.append((int(head.split(b" ")[1]), head, body))
    finally:
        writer.close()
    return out


def _post(body: bytes, *extra: str) -> bytes:
    fields = "".join(f"{f}\r\n" for f in extra)
    return (
        f"POST /publish HTTP/1.1\r\nHost: n\r\nAuthorization: Bearer {PUBLISH_SECRET}\r\n"
        f"{fields}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


EVENT = b'{"verb":"game","payload":{"meta":"chess","id":"g1"}}'


async def test_pipelined_requests_on_one_connection_are_answered_in_order(
    server: RunningServer,
) -> None:
    data = _post(EVENT) + _post(EVENT) + b"GET /healthz HTTP/1.1\r\nHost: n\r\n\r\n"
    answers = await _exchange(server, data, 3)
    assert [status for status, _, _ in answers] == [202, 202, 200]
    offsets = [
        next(iter(json.loads(body)["positions"].values()))["offset"] for _, _, body in answers[:2]
    ]
    assert offsets[1] == offsets[0] + 1
    assert json.loads(answers[2][2]) == {"status": "ok", "node": "test-node"}


async def test_a_chunked_publish_after_100_continue(server: RunningServer) -> None:
    watcher = await server.subscribed("alice", games=[("chess", "g1")])
    port = int(server.http_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST /publish HTTP/1.1\r\nAuthorization: Bearer {PUBLISH_SECRET}\r\n"
            "Expect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(b"10\r\n" + EVENT[:16] + b"\r\n" + f"{len(EVENT) - 16:x}\r\n".encode())
        writer.write(EVENT[16:] + b"\r\n0\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 202 Accepted\r\n")
    finally:
        writer.close()
    await watcher.next_message(lambda m: m.get("verb") == "game")


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"POST /publish HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400),
        (_post(b"x" * (128 * 1024 + 1)), 413),
        (b"GET /healthz HTTP/3\r\n\r\n", 505),
    ],
)
async def test_a_request_that_cannot_be_taken_is_answered_then_the_connection_closed(
    server: RunningServer, data: bytes, status: int
) -> None:
    port = int(server.http_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data + b"GET /healthz HTTP/1.1\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: nothing after the refusal
    finally:
        writer.close()
    assert answer.startswith(f"HTTP/1.1 {status} ".encode())
    assert b"Connection: close\r\n" in answer and answer.count(b"\r\n\r\n") == 1
    assert "error" in json.loads(answer.partition(b"\r\n\r\n")[2])


async def test_wrong_methods_name_the_allowed_ones_and_head_sends_no_body(
    server: RunningServer,
) -> None:
    ((status, head, _),) = await _exchange(server, b"DELETE /metrics HTTP/1.1\r\n\r\n", 1)
    assert status == 405 and b"Allow: GET, HEAD\r\n" in head
    ((status, head, body),) = await _exchange(server, b"HEAD /healthz HTTP/1.1\r\n\r\n", 1)
    length = len(b'{"status":"ok","node":"test-node"}')
    assert status == 200 and body == b"" and f"Content-Length: {length}\r\n".encode() in head


async def test_the_sweep_closes_idle_and_stalled_connections_only(server: RunningServer) -> None:
    from server.ingress import http_server

    listener = server.listener
    port = int(server.http_url.rsplit(":", 1)[1])
    idle = await asyncio.open_connection("127.0.0.1", port)
    stalled = await asyncio.open_connection("127.0.0.1", port)
    stalled[1].write(b"POST /publish HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
    await asyncio.sleep(0.2)
    assert len(listener.connections) == 2
    now = asyncio.get_running_loop().time()
    listener.sweep(now + http_server.REQUEST_SECONDS - 1)
    assert len(listener.connections) == 2  # neither past its limit yet
    listener.sweep(now + http_server.REQUEST_SECONDS + 1)
    assert await asyncio.wait_for(stalled[0].read(), 5) == b""  # midway: 30 s is enough
    assert len(listener.connections) == 1
    listener.sweep(now + http_server.KEEPALIVE_SECONDS + 1)
    assert await asyncio.wait_for(idle[0].read(), 5) == b""
    for _, writer in (idle, stalled):
        writer.close()


def test_the_listener_runs_on_uvloop() -> None:
    """The node runs on uvloop, whose transports are not asyncio's classes."""
    import urllib.request

    import uvloop

    from server.ingress.http_server import HttpListener
    from server.ingress.routes import Reply, Routes

    async def main() -> tuple[int, bytes]:
        async def hello(request: object) -> Reply:
            return Reply(200, b"hi", "text/plain")

        routes = Routes()
        routes.add("GET", "/", hello)
        listener = HttpListener(routes, 1024)
        await listener.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{listener.port}/"

        def get() -> tuple[int, bytes]:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read()

        try:
            return await asyncio.to_thread(get)
        finally:
            await listener.stop()

    assert uvloop.run(main()) == (200, b"hi")


async def test_a_client_that_pipelines_without_reading_is_not_read_either(
    server: RunningServer,
) -> None:
    """Answers wait in our buffer only up to its high-water mark; then its requests
    wait in the kernel. Synchronous answers (404) come in a loop, not a recursion."""
    port = int(server.http_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**20)
    requests = 6000
    try:
        for n in range(requests):
            path = "/metrics" if n % 2 else "/nope"
            writer.write(f"GET {path} HTTP/1.1\r\nHost: n\r\n\r\n".encode())
        await asyncio.sleep(0.5)
        (connection,) = server.listener.connections
        await eventually(lambda: connection.write_blocked, 30, "the connection blocked on writing")
        assert connection.reading_paused and connection.transport is not None
        high = connection.transport.get_write_buffer_limits()[1]
        biggest = 64 * 1024  # a /metrics answer is a few KiB
        assert connection.transport.get_write_buffer_size() <= high + biggest
        statuses = []
        for _ in range(requests):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            statuses.append(int(head.split(b" ")[1]))
        assert statuses == [404, 200] * (requests // 2)
    finally:
        writer.close()


async def test_requests_sent_before_the_clients_eof_are_answered_then_closed(
    server: RunningServer,
) -> None:
    port = int(server.http_url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_post(EVENT) + b"GET /healthz HTTP/1.1\r\n\r\n")
        writer.write_eof()
        answer = await asyncio.wait_for(reader.read(), 5)  # to EOF: closed once answered
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 202 Accepted\r\n")
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 1
