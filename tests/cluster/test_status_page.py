"""The operator's page in headless Chromium against a running two-node cluster.

The numbers it shows must be the ones ``/metrics`` gives; the screenshot is
kept in ``test-artifacts/status-page.png`` for a person to look at.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

from tests.client import Client
from tests.cluster.harness import ROOT, Cluster
from tests.test_hardening import ping_frames

BROWSER_DIR = Path(__file__).parents[1] / "browser"
ARTIFACTS = ROOT / "test-artifacts"


async def metrics(cluster: Cluster, name: str) -> dict[str, float]:
    async with cluster._session().get(cluster.nodes[name].http_url + "/metrics") as response:
        text = await response.text()
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


async def test_the_operators_page_shows_live_numbers_and_every_node(pair: Cluster) -> None:
    chromium, node = shutil.which("chromium"), shutil.which("node")
    assert chromium and node, "run scripts/bootstrap: it installs chromium and node packages"
    cluster = pair
    await cluster.start("n1", "n2")
    for i in range(6):
        await cluster.client("n1", f"u{i % 4}", games=[("chess", f"g{i % 3}")])
    for i in range(3):
        await cluster.client("n2", f"v{i}")
    # One flooder spends its credits: the page's rate-limit closes must count it.
    flooder = await Client.open(cluster.nodes["n1"].ws_url)
    flooder.ws.transport.write(ping_frames(200))
    assert (await flooder.closed(within=10))[0] == 1008
    for _ in range(200):  # the node forgets the flooder a moment after closing it
        if (await metrics(cluster, "n1"))["ap_connections"] == 6:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("n1 still counts the flooder's socket after 10 s")
    writer = await cluster.wait_leader()
    before = await metrics(cluster, "n1")
    await asyncio.sleep(2.5)  # two history samples for the chart

    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "status-page.png"
    screenshot.unlink(missing_ok=True)
    config = {
        "url": cluster.nodes["n1"].http_url + "/",
        "chromium": chromium,
        "screenshot": str(screenshot),
        "nodes": 2,
    }
    process = await asyncio.create_subprocess_exec(
        node,
        str(BROWSER_DIR / "status.mjs"),
        json.dumps(config),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    lines = stdout.decode().strip().splitlines()
    assert lines, stderr.decode()
    shown = json.loads(lines[-1])
    assert shown["ok"], shown
    after = await metrics(cluster, "n1")

    fields = shown["fields"]
    assert fields["node"] == "n1" and fields["mode"] == "cluster" and fields["state"] == "ready"
    for field, metric in [
        ("connections", "ap_connections"),
        ("users", "ap_users"),
        ("watched_games", "ap_watched_games"),
        ("slow_consumer", "ap_slow_consumers_total"),
        ("rate_limited", "ap_flood_closes_total"),
    ]:
        assert before[metric] == after[metric] == float(fields[field]), field
    assert (fields["connections"], fields["users"], fields["watched_games"]) == ("6", "4", "3")
    assert float(fields["rate_limited"]) >= 1
    seq = float(fields["presence_seq"])
    assert before["ap_presence_seq"] <= seq <= after["ap_presence_seq"]
    assert fields["bus"] == "redis up" and fields["store"].startswith("dynamodb")
    assert fields["presence_writer"] == ("this node" if writer == "n1" else "another node")

    rows = {row[0]: row for row in shown["nodes"]}
    assert set(rows) == {"n1", "n2"}
    assert rows["n1"][2] == "4" and rows["n2"][2] == "3"  # users per node
    for row in rows.values():
        assert float(row[1].removesuffix(" s")) < 5  # heartbeat age
    assert rows[writer][3] == "yes"
    assert shown["chartInk"] > 100, "the chart drew nothing"
    assert shown["foreign"] == [], "the page loaded something from elsewhere"
    assert screenshot.stat().st_size > 10_000
