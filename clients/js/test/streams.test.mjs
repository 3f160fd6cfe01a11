import { test } from "node:test";
import assert from "node:assert/strict";
import { judge, Positions, Streams, MAX_STREAMS } from "../build/lib/streams.js";

class MemoryStorage {
  items = new Map();
  writes = 0;
  getItem(key) {
    return this.items.has(key) ? this.items.get(key) : null;
  }
  setItem(key, value) {
    this.writes++;
    this.items.set(key, String(value));
  }
}

/** A Streams with a recording sink; `positionsSeen` records the stored position at each call. */
function tracker({ coalesce = [], storage = new MemoryStorage(), throwing = false } = {}) {
  const calls = [];
  const positions = new Positions(storage, "k");
  const at = (stream) => positions.get(stream)?.offset;
  const sink = {
    deliver(verb, payload, info) {
      calls.push({ kind: "deliver", verb, payload, info, storedOffset: at(info.stream) });
      if (throwing) throw new Error("handler bug");
    },
    resync(stream, info) {
      calls.push({ kind: "resync", stream, info, storedOffset: at(stream) });
    },
    recovered(info) {
      calls.push({ kind: "recovered", info });
    },
  };
  return { streams: new Streams(positions, new Set(coalesce), sink), calls, positions, storage };
}

const ev = (offset, verb = "game", epoch = "e1", stream = "game:chess#g1") => ({
  verb,
  payload: verb === "skip" ? undefined : { meta: "chess", id: "g1", n: offset },
  stream,
  epoch,
  offset,
});
const delivered = (calls) => calls.filter((c) => c.kind === "deliver").map((c) => c.info.offset);

test("judge: first, next, old, gap, epoch", () => {
  assert.equal(judge(undefined, "e", 4), "first");
  assert.equal(judge({ epoch: "", offset: 0 }, "e", 4), "first");
  assert.equal(judge({ epoch: "e", offset: 3 }, "e", 4), "next");
  assert.equal(judge({ epoch: "e", offset: 3 }, "e", 3), "old");
  assert.equal(judge({ epoch: "e", offset: 3 }, "e", 1), "old");
  assert.equal(judge({ epoch: "e", offset: 3 }, "e", 5), "gap");
  assert.equal(judge({ epoch: "e", offset: 3 }, "f", 1), "epoch");
});

test("positions survive in the storage, and corrupt storage starts afresh", () => {
  const storage = new MemoryStorage();
  new Positions(storage, "k").set("game:a#1", "e", 7);
  assert.deepEqual(new Positions(storage, "k").get("game:a#1"), { epoch: "e", offset: 7 });
  storage.setItem("k", "{not json");
  assert.equal(new Positions(storage, "k").get("game:a#1"), undefined);
  const failing = {
    getItem: () => null,
    setItem: () => {
      throw new Error("QuotaExceededError");
    },
  };
  const positions = new Positions(failing, "k");
  positions.set("s", "e", 1);
  assert.deepEqual(positions.get("s"), { epoch: "e", offset: 1 }, "kept in memory");
  const none = new Positions(null, "k");
  none.set("s", "e", 2);
  assert.equal(none.get("s").offset, 2);
});

test("positions are bounded: the stream moved least recently goes first", () => {
  const positions = new Positions(null, "k");
  for (let i = 0; i < MAX_STREAMS; i++) positions.set(`s${i}`, "e", 1);
  positions.set("s0", "e", 2); // touched again: now the newest
  positions.set("new", "e", 1);
  assert.ok(positions.get("s0"));
  assert.equal(positions.get("s1"), undefined);
  assert.ok(positions.get("new"));
});

test("each event once: duplicates at or below the position are dropped", () => {
  const { streams, calls, positions } = tracker();
  positions.set("game:chess#g1", "e1", 2);
  for (const offset of [1, 2, 3, 3, 2, 4]) streams.frame(ev(offset));
  assert.deepEqual(delivered(calls), [3, 4]);
  assert.deepEqual(positions.get("game:chess#g1"), { epoch: "e1", offset: 4 });
});

test("the position advances only after the handler returns, even if it throws", () => {
  const { streams, calls, positions } = tracker({ throwing: true });
  positions.set("game:chess#g1", "e1", 2);
  assert.throws(() => streams.frame(ev(3)));
  assert.equal(
    calls[0].storedOffset,
    2,
    "inside the handler the stored position is still the old one",
  );
  assert.equal(positions.get("game:chess#g1").offset, 3);
});

test("a gap in offsets triggers one resync and still delivers the event", () => {
  const { streams, calls } = tracker();
  streams.frame(ev(1));
  streams.frame(ev(4));
  streams.frame(ev(5));
  assert.deepEqual(
    calls.map((c) => c.kind),
    ["deliver", "resync", "deliver", "deliver"],
  );
  assert.equal(calls[1].info.reason, "gap");
  assert.deepEqual(delivered(calls), [1, 4, 5]);
});

test("a new epoch on a live event triggers a resync", () => {
  const { streams, calls, positions } = tracker();
  positions.set("game:chess#g1", "e1", 9);
  streams.frame(ev(1, "game", "e2"));
  assert.deepEqual(
    calls.map((c) => c.kind),
    ["resync", "deliver"],
  );
  assert.equal(calls[0].info.reason, "epoch");
  assert.deepEqual(positions.get("game:chess#g1"), { epoch: "e2", offset: 1 });
});

test("skip frames advance the position and reach no handler", () => {
  const { streams, calls, positions } = tracker();
  positions.set("game:chess#g1", "e1", 1);
  streams.frame(ev(2, "skip"));
  streams.frame(ev(3));
  assert.deepEqual(delivered(calls), [3]);
  assert.equal(calls.length, 1, "no resync: the skip kept the offsets contiguous");
});

test("begin: known positions, or an empty one to learn the stream", () => {
  const { streams, positions } = tracker();
  positions.set("game:a#1", "e1", 4);
  assert.deepEqual(streams.begin(["game:a#1", "user:alice"]), {
    "game:a#1": { epoch: "e1", offset: 4 },
    "user:alice": { epoch: "", offset: 0 },
  });
});

test("recovered: true reports the replay count; no resync", () => {
  const { streams, calls, positions } = tracker();
  positions.set("game:chess#g1", "e1", 2);
  streams.begin(["game:chess#g1"]);
  streams.frame(ev(3));
  streams.frame(ev(4));
  streams.answer({ stream: "game:chess#g1", recovered: true, epoch: "e1", offset: 4 });
  streams.frame(ev(5));
  assert.deepEqual(
    calls.map((c) => c.kind),
    ["deliver", "deliver", "recovered", "deliver"],
  );
  assert.deepEqual(
    calls.filter((c) => c.kind === "deliver").map((c) => c.info.replayed),
    [true, true, false],
  );
  assert.deepEqual(calls[2].info, {
    stream: "game:chess#g1",
    wasRecovering: true,
    recovered: true,
    replayed: 2,
  });
});

test("recovered: false calls resync once, at the answer, before the position moves on", () => {
  const { streams, calls, positions } = tracker();
  positions.set("game:chess#g1", "e1", 2);
  streams.begin(["game:chess#g1"]);
  streams.answer({ stream: "game:chess#g1", recovered: false, epoch: "e2", offset: 7 });
  assert.deepEqual(
    calls.map((c) => c.kind),
    ["resync", "recovered"],
  );
  assert.deepEqual(calls[0].info, {
    stream: "game:chess#g1",
    wasRecovering: true,
    recovered: false,
    replayed: 0,
    reason: "recovery",
    epoch: "e2",
    offset: 7,
  });
  assert.equal(calls[0].storedOffset, 2);
  assert.deepEqual(positions.get("game:chess#g1"), { epoch: "e2", offset: 7 });
  streams.frame(ev(8, "game", "e2"));
  assert.deepEqual(
    calls.map((c) => c.kind),
    ["resync", "recovered", "deliver"],
    "the next live event is no gap",
  );
});

test("a first look at a stream learns its position without a resync", () => {
  const { streams, calls, positions } = tracker();
  streams.begin(["user:alice"]);
  streams.answer({ stream: "user:alice", recovered: false, epoch: "u1", offset: 12 });
  assert.deepEqual(
    calls.map((c) => c.kind),
    ["recovered"],
  );
  assert.equal(calls[0].info.wasRecovering, false);
  assert.deepEqual(positions.get("user:alice"), { epoch: "u1", offset: 12 });
});

test("a live recovered:false (a node lost the stream) is a resync", () => {
  const { streams, calls } = tracker();
  streams.frame(ev(1));
  streams.answer({ stream: "game:chess#g1", recovered: false, epoch: "e9", offset: 3 });
  assert.deepEqual(
    calls.map((c) => c.kind),
    ["deliver", "resync", "recovered"],
  );
});

test("coalesce: a replayed burst for one game is one call carrying all of it", () => {
  const { streams, calls, positions } = tracker({ coalesce: ["game"] });
  positions.set("game:chess#g1", "e1", 0 + 1);
  streams.begin(["game:chess#g1"]);
  for (let offset = 2; offset <= 51; offset++) streams.frame(ev(offset));
  assert.equal(calls.length, 0, "held until the answer");
  streams.answer({ stream: "game:chess#g1", recovered: true, epoch: "e1", offset: 51 });
  assert.deepEqual(
    calls.map((c) => c.kind),
    ["deliver", "recovered"],
  );
  const [call] = calls;
  assert.equal(call.info.batch.length, 50);
  assert.deepEqual(
    call.info.batch.map((p) => p.n),
    Array.from({ length: 50 }, (_, i) => i + 2),
  );
  assert.equal(call.payload.n, 51, "the payload is the newest");
  assert.equal(call.storedOffset, 1, "the position moves after the call");
  assert.equal(positions.get("game:chess#g1").offset, 51);
  assert.equal(calls[1].info.replayed, 50);
  streams.frame(ev(52));
  assert.equal(calls[2].info.batch.length, 1, "live events are not held");
});

test("coalesce keeps the order: another verb splits the burst, skips ride along", () => {
  const { streams, calls } = tracker({ coalesce: ["game"] });
  streams.begin(["game:chess#g1"]);
  streams.frame(ev(1));
  streams.frame(ev(2, "skip"));
  streams.frame(ev(3));
  streams.frame(ev(4, "chat"));
  streams.frame(ev(5));
  streams.frame(ev(6, "skip"));
  streams.answer({ stream: "game:chess#g1", recovered: true, epoch: "e1", offset: 6 });
  const deliveries = calls.filter((c) => c.kind === "deliver");
  assert.deepEqual(
    deliveries.map((c) => [c.verb, c.info.batch.map((p) => p.n)]),
    [
      ["game", [1, 3]],
      ["chat", [4]],
      ["game", [5]],
    ],
  );
  assert.equal(calls.filter((c) => c.kind === "resync").length, 0);
});

test("coalesce: held frames are delivered, not lost, when the socket goes", () => {
  const { streams, calls, positions } = tracker({ coalesce: ["game"] });
  streams.begin(["game:chess#g1"]);
  streams.frame(ev(1));
  streams.frame(ev(2));
  streams.reset();
  assert.deepEqual(
    calls.map((c) => c.info.batch.length),
    [2],
  );
  assert.equal(positions.get("game:chess#g1").offset, 2);
  streams.frame(ev(3));
  assert.equal(calls[1].info.replayed, false, "after reset the stream is live again");
});

test("coalesce: duplicates in a replay are still dropped against the held frames", () => {
  const { streams, calls } = tracker({ coalesce: ["game"] });
  streams.begin(["game:chess#g1"]);
  streams.frame(ev(1));
  streams.frame(ev(2));
  streams.frame(ev(2));
  streams.frame(ev(1));
  streams.answer({ stream: "game:chess#g1", recovered: true, epoch: "e1", offset: 2 });
  assert.deepEqual(
    calls[0].info.batch.map((p) => p.n),
    [1, 2],
  );
  assert.equal(calls[1].info.replayed, 2);
});

test("drop: an action the server refused leaves its streams live, nothing held", () => {
  const { streams, calls } = tracker({ coalesce: ["game"] });
  streams.begin(["game:chess#g1"]);
  streams.drop(["game:chess#g1"]);
  streams.frame(ev(1));
  assert.deepEqual(
    calls.map((c) => [c.kind, c.info.replayed]),
    [["deliver", false]],
  );
});
