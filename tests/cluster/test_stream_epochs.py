"""A node knows every stream it serves, also one it holds only through a
recovery: after Redis restarts without its data, every holder hears of the new
epoch as ``recovered: false`` with the real epoch and top, before any event of
it, and no event of the new epoch is skipped without notice.

The defects these pin down were found by the chaos soak (issue 20): a tab whose
node held its stream only through a recovery got offset 1 of a new epoch with no
notice; when offset 1 was accepted on another node before this node had
resubscribed, the tab got offset 2, never offset 1, and was not told; and a
``since`` answered while Redis was away said ``recovered: false`` with the old
epoch and offset 0.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from tests.client import Client, dev_token
from tests.cluster.harness import SLACK, Cluster
from tests.services import RedisServer
from tests.waiting import eventually

STREAM = "game:chess#e1"
GAMES = [("chess", "e1")]


def move(n: int | str) -> dict[str, Any]:
    return {"verb": "game", "payload": {"meta": "chess", "id": "e1", "n": n}}


async def publish(cluster: Cluster, node: str, n: int | str) -> dict[str, Any]:
    status, reply = await cluster.publish_reply(node, move(n))
    assert status == 202, reply
    position: dict[str, Any] = reply["positions"][STREAM]
    return position


async def wait_offset(tab: Client, old: str, offset: int) -> None:
    try:
        await tab.wait_for(
            lambda: offset in [m.get("offset") for m in frames_after_answer(tab, old)], 10 + SLACK
        )
    except TimeoutError:
        raise AssertionError(
            f"offset {offset} never came: {frames_after_answer(tab, old)}"
        ) from None


async def recovery_only_holder(cluster: Cluster, user: str) -> tuple[Client, str]:
    """A tab that saw offsets 1..3 on n1, then moved to n2 with ``since``: n2
    holds the stream only through that recovery (no live event since)."""
    first = await cluster.client("n1", user, games=GAMES, since={})
    await first.barrier()
    epoch = ""
    for n in range(1, 4):
        epoch = (await publish(cluster, "n3", n))["epoch"]
    await first.wait_for(lambda: len(first.offsets(STREAM)) == 3, 5 + SLACK)
    await first.close()
    tab = await cluster.client(
        "n2", user, games=GAMES, since={STREAM: {"epoch": epoch, "offset": 3}}
    )
    answer = await tab.wait_recovered(STREAM, within=5 + SLACK)
    assert answer == {"stream": STREAM, "recovered": True, "epoch": epoch, "offset": 3}
    return tab, epoch


def frames_after_answer(tab: Client, old_epoch: str) -> list[dict[str, Any]]:
    """Stream frames and answers of ``STREAM`` after the recovery answer."""
    out: list[dict[str, Any]] = []
    answered = False
    for message in tab.messages:
        if message.get("verb") == "recovered" and message["payload"]["stream"] == STREAM:
            if not answered:
                answered = True
                continue
            out.append(message)
        elif answered and message.get("stream") == STREAM:
            out.append(message)
    return out


def assert_announced_first(frames: list[dict[str, Any]], new_epoch: str, last: int) -> None:
    """A ``recovered: false`` in the new epoch comes first; then the new epoch's
    events follow it at consecutive offsets up to ``last``."""
    assert frames, "nothing arrived after the restart"
    notice = frames[0]
    assert notice.get("verb") == "recovered", f"an event came before any notice: {frames[:3]}"
    payload = notice["payload"]
    assert payload["recovered"] is False and payload["epoch"] == new_epoch, payload
    events = [m for m in frames[1:] if m.get("verb") != "recovered"]
    assert all(m["epoch"] == new_epoch for m in events), events
    offsets = [m["offset"] for m in events]
    assert offsets == list(range(payload["offset"] + 1, last + 1)), (payload, offsets)


async def test_a_new_epoch_reaches_a_recovery_only_holder_before_its_events(
    cluster: Cluster,
) -> None:
    tab, old = await recovery_only_holder(cluster, "holder")
    assert isinstance(cluster.redis, RedisServer)
    cluster.redis.restart()
    for node in ("n1", "n2", "n3"):
        await cluster.wait_ready(node, within=15)
    new = (await publish(cluster, "n3", "after-1"))["epoch"]
    assert new != old
    await publish(cluster, "n3", "after-2")
    await wait_offset(tab, old, 2)
    assert_announced_first(frames_after_answer(tab, old), new, 2)


async def test_offset_one_of_a_new_epoch_taken_before_the_holder_resubscribed_is_not_lost(
    cluster: Cluster,
) -> None:
    tab, old = await recovery_only_holder(cluster, "late")
    assert isinstance(cluster.redis, RedisServer)
    holder = cluster.nodes["n2"]
    holder.process.send_signal(signal.SIGSTOP)  # n2 resubscribes only after offset 1
    try:
        cluster.redis.restart()
        for node in ("n1", "n3"):
            await cluster.wait_ready(node, within=15)
        new = (await publish(cluster, "n3", "after-1"))["epoch"]
        assert new != old
    finally:
        holder.process.send_signal(signal.SIGCONT)
    await cluster.wait_ready("n2", within=15)
    await publish(cluster, "n3", "after-2")
    await wait_offset(tab, old, 2)
    frames = frames_after_answer(tab, old)
    assert_announced_first(frames, new, 2)
    # Offset 1 arrived, or the notice's top covers it: never skipped in silence.
    assert frames[0]["payload"]["offset"] >= 1 or 1 in [m.get("offset") for m in frames[1:]]


async def test_a_since_answered_while_redis_is_away_carries_the_real_epoch_and_top(
    cluster: Cluster,
) -> None:
    first = await cluster.client("n1", "asker", games=GAMES, since={})
    await first.barrier()
    old = ""
    for n in range(1, 4):
        old = (await publish(cluster, "n3", n))["epoch"]
    await first.wait_for(lambda: len(first.offsets(STREAM)) == 3, 5 + SLACK)
    await first.close()
    assert isinstance(cluster.redis, RedisServer)
    cluster.redis.stop()
    tab = await Client.open(cluster.nodes["n2"].ws_url)
    cluster.clients.append(tab)
    await tab.send(
        {
            "action": "subscribe",
            "token": dev_token("asker"),
            "watchVersion": 1,
            "wantsPresence": False,
            "games": [{"meta": "chess", "id": "e1"}],
            "since": {STREAM: {"epoch": old, "offset": 3}},
        }
    )
    await asyncio.sleep(1.0)  # the node tries its history while Redis is away
    cluster.redis.start()
    for node in ("n1", "n2", "n3"):
        await cluster.wait_ready(node, within=15)
    positions = [await publish(cluster, "n3", f"after-{n}") for n in (1, 2)]
    new = positions[0]["epoch"]
    assert new != old
    await eventually(lambda: bool(tab.recovered(STREAM)), 10, "the since answered")
    answer = tab.recovered(STREAM)[0]
    assert answer["recovered"] is False
    assert answer["epoch"] == new, f"answered with {answer}, the stream is at {positions[-1]}"
    assert 0 <= answer["offset"] <= 2
    # The events past the top it was told follow, and only those.
    if answer["offset"] < 2:
        await tab.wait_for(lambda: 2 in tab.offsets(STREAM), 10 + SLACK)
    await tab.barrier()
    after = [m["offset"] for m in tab.on_stream(STREAM)]
    assert after == list(range(answer["offset"] + 1, 3))
