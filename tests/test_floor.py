"""The C fan-out floor (``loadtest/harness/floor.c``): compiled, run, and its frames ours."""

from __future__ import annotations

from loadtest.harness.floor import Floor, floor_frame
from protocol.codec import Frame
from protocol.messages import GameEvent, Positioned


async def test_the_floor_sends_each_frame_to_each_watcher() -> None:
    games = [("chess", "g1"), ("go", "g2")]
    # socket 0 watches both games, socket 1 the first, socket 2 none
    floor = Floor(3, games, [[0, 1], [0], []])
    try:
        run = await floor.run(0.3, 50.0)
    finally:
        floor.close()
    assert run.send_failures == 0
    assert run.events > 0
    per_game = [2, 1]  # watchers of each game; event i goes to game i mod 2
    expected = sum(per_game[i % 2] for i in range(run.events))
    assert run.frames == expected
    sizes = [len(floor_frame(*game)) for game in games]
    assert run.bytes == sum(sizes[i % 2] * per_game[i % 2] for i in range(run.events))
    assert run.cpu_s > 0 and run.figures()["delivered_per_cpu_s"] > 0


def test_the_floor_frame_is_the_one_our_server_writes() -> None:
    frame = floor_frame("chess", "g1", offset=7)
    # an unmasked text frame: FIN + opcode 1, then the length, then the JSON
    assert frame[0] == 0x81 and frame[1] & 0x80 == 0
    text = frame[2:] if frame[1] < 126 else frame[4:]
    assert text.startswith(b'{"verb":"game","payload":{"meta":"chess","id":"g1"')
    assert b'"stream":"game:chess#g1"' in text and text.endswith(b'"offset":7}')
    event = GameEvent("game", "chess", "g1", {})
    ours = Frame(Positioned(event, "game:chess#g1", "0123456789", 7)).text_wire
    assert ours[0] == frame[0]
