import { test } from "node:test";
import assert from "node:assert/strict";
import { applyPresence } from "../build/lib/presence.js";

const snapshot = { type: "snapshot", seq: 5, totalCount: 3, visibleUserIds: ["a", "b"] };

test("a snapshot replaces the state, whatever its seq", () => {
  const { presence, gap } = applyPresence(
    { seq: 9, totalCount: 9, visibleUserIds: ["z"] },
    snapshot,
  );
  assert.deepEqual(presence, { seq: 5, totalCount: 3, visibleUserIds: ["a", "b"] });
  assert.equal(gap, false);
});

test("the next delta applies leaves then joins, with the delta's own totalCount", () => {
  const base = applyPresence(null, snapshot).presence;
  const { presence, gap } = applyPresence(base, {
    type: "delta",
    seq: 6,
    joins: ["c", "a"],
    leaves: ["a", "b"],
    totalCount: 4,
  });
  assert.equal(gap, false);
  assert.deepEqual(
    { ...presence, visibleUserIds: presence.visibleUserIds.sort() },
    { seq: 6, totalCount: 4, visibleUserIds: ["a", "c"] },
  );
  assert.deepEqual(base.visibleUserIds, ["a", "b"], "the previous state is not mutated");
});

test("without totalCount, the count moves by joins minus leaves, never below 0", () => {
  const base = { seq: 1, totalCount: 1, visibleUserIds: ["a"] };
  assert.equal(
    applyPresence(base, { type: "delta", seq: 2, joins: ["b"], leaves: [] }).presence.totalCount,
    2,
  );
  assert.equal(
    applyPresence(base, { type: "delta", seq: 2, joins: [], leaves: ["a", "x"] }).presence
      .totalCount,
    0,
  );
});

test("an old delta changes nothing; a skipped seq is a gap", () => {
  const base = { seq: 5, totalCount: 3, visibleUserIds: ["a"] };
  const old = applyPresence(base, { type: "delta", seq: 5, joins: ["q"], leaves: [] });
  assert.equal(old.presence, base);
  assert.equal(old.gap, false);
  const ahead = applyPresence(base, { type: "delta", seq: 7, joins: ["q"], leaves: [] });
  assert.equal(ahead.presence, base);
  assert.equal(ahead.gap, true);
});

test("a delta before any snapshot is a gap", () => {
  assert.deepEqual(applyPresence(null, { type: "delta", seq: 1, joins: [], leaves: [] }), {
    presence: null,
    gap: true,
  });
});
