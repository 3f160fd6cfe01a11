import { test } from "node:test";
import assert from "node:assert/strict";
import {
  backoffDelay,
  closePlan,
  BACKOFF_MIN_MS,
  BACKOFF_MAX_MS,
  OVERLOAD_MIN_MS,
} from "../build/lib/policy.js";

const at = (value) => () => value;

test("backoff: full jitter between the floor and a doubling ceiling, capped at 30 s", () => {
  assert.equal(backoffDelay(0, undefined, undefined, at(0)), 500);
  assert.equal(backoffDelay(0, undefined, undefined, at(1)), 2000);
  assert.equal(backoffDelay(1, undefined, undefined, at(1)), 4000);
  assert.equal(backoffDelay(3, undefined, undefined, at(1)), 16000);
  assert.equal(backoffDelay(5, undefined, undefined, at(1)), BACKOFF_MAX_MS);
  assert.equal(backoffDelay(500, undefined, undefined, at(1)), BACKOFF_MAX_MS);
  assert.equal(backoffDelay(500, undefined, undefined, at(0)), BACKOFF_MIN_MS);
  assert.equal(backoffDelay(2, undefined, undefined, at(0.5)), 500 + 0.5 * 7500);
});

test("backoff: the overload floor is 5 s and the ceiling still 30 s", () => {
  assert.equal(backoffDelay(0, OVERLOAD_MIN_MS, undefined, at(0)), 5000);
  assert.equal(backoffDelay(0, OVERLOAD_MIN_MS, undefined, at(1)), 10000);
  assert.equal(backoffDelay(9, OVERLOAD_MIN_MS, undefined, at(1)), 30000);
});

test("backoff: spread over the whole range with Math.random", () => {
  const delays = Array.from({ length: 2000 }, () => backoffDelay(3));
  assert.ok(delays.every((d) => d >= 500 && d <= 16000));
  assert.ok(
    Math.min(...delays) < 1500 && Math.max(...delays) > 15000,
    "full jitter, not equal jitter",
  );
});

const plan = (code, extra = {}) => closePlan({ code, opened: true, refreshed: false, ...extra });

test("1012: reconnect after the restart spread, no backoff step", () => {
  assert.deepEqual(plan(1012), { stop: false, wait: "restart" });
});

test("1013 and a socket that never opened (a 503 at upgrade): the longer floor", () => {
  assert.deepEqual(plan(1013), { stop: false, wait: "overload" });
  assert.deepEqual(plan(1006, { opened: false }), { stop: false, wait: "overload" });
});

test("4008: reconnect and recover, with a warning", () => {
  const p = plan(4008);
  assert.equal(p.stop, false);
  assert.equal(p.wait, "backoff");
  assert.match(p.log, /slow consumer/);
  assert.ok(!p.bug);
});

test("4408: reconnect, logged as a client bug", () => {
  const p = plan(4408);
  assert.deepEqual([p.stop, p.wait, p.bug], [false, "backoff", true]);
});

test("4509: stop", () => {
  assert.equal(plan(4509).stop, true);
});

test("1008: one token refresh, then stop; a flood is not a token problem", () => {
  assert.deepEqual(plan(1008, { error: "unauthorized" }), { stop: false, wait: "refresh" });
  assert.equal(plan(1008, { error: "unauthorized", refreshed: true }).stop, true);
  assert.equal(plan(1008, { refreshed: true }).stop, true);
  const flood = plan(1008, { error: "rate_limited", refreshed: true });
  assert.deepEqual([flood.stop, flood.wait, flood.bug], [false, "overload", true]);
});

test("1001: wait for the page to be visible", () => {
  assert.deepEqual(plan(1001), { stop: false, wait: "visible" });
});

test("anything else that opened (1006 after open, 1011, 1000): backoff", () => {
  for (const code of [1006, 1011, 1000, 1005, 4000])
    assert.deepEqual(plan(code), { stop: false, wait: "backoff" });
});
