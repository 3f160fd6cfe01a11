import { test } from "node:test";
import assert from "node:assert/strict";
import { setup, flush, MemoryStorage, FakeSocket } from "./fake.mjs";

const game = (offset, extra = {}) => ({
  verb: "game",
  payload: { meta: "chess", id: "g1" },
  stream: "game:chess#g1",
  epoch: "e1",
  offset,
  ...extra,
});
const randomAt = (t, value) => t.mock.method(Math, "random", () => value);

test("subscribe: games, since for each game and the user stream, heartbeat, ackId; connected at the ack", async (t) => {
  const storage = new MemoryStorage();
  storage.setItem("ap-realtime", JSON.stringify({ "game:chess#g1": ["e1", 4] }));
  const h = setup(t, {
    games: [
      { meta: "chess", id: "g1" },
      { meta: "go", id: "g2" },
      { meta: "bad#", id: "x" },
    ],
    storage,
  });
  assert.equal(h.client.state, "connecting");
  await flush();
  assert.deepEqual(h.tokens, [{ refresh: false }]);
  const socket = h.socket();
  socket.open();
  const [subscribe] = socket.sent;
  assert.equal(subscribe.action, "subscribe");
  assert.deepEqual(
    subscribe.games,
    [
      { meta: "chess", id: "g1" },
      { meta: "go", id: "g2" },
    ],
    "a ref the server refuses is not sent",
  );
  assert.deepEqual(subscribe.since, {
    "game:chess#g1": { epoch: "e1", offset: 4 },
    "game:go#g2": { epoch: "", offset: 0 },
    "user:alice": { epoch: "", offset: 0 },
  });
  assert.equal(subscribe.heartbeat, true);
  assert.equal(subscribe.watchVersion, 1);
  assert.equal(typeof subscribe.ackId, "string");
  assert.equal(h.client.state, "connecting", "an open socket is not yet connected");
  socket.receive({ verb: "ack", payload: { ackId: "nope", action: "subscribe" } });
  assert.equal(h.client.state, "connecting", "another action's ack is not this one");
  socket.ack({ heartbeatSeconds: 15 });
  assert.equal(h.client.state, "connected");
  assert.deepEqual(
    h.named("state").map((e) => e[0]),
    ["connected"],
  );
  assert.equal(h.named("connected").length, 1);
});

test("backoff grows on every failure path, before the socket opens too, and resets only at the ack", async (t) => {
  randomAt(t, 1); // the top of each range
  const h = setup(t);
  await flush();
  h.socket().serverClose(1006); // never opened: the longer floor, [5 s, 10 s]
  await h.tick(9_999);
  assert.equal(h.sockets.length, 1);
  await h.tick(1);
  assert.equal(h.sockets.length, 2);
  h.socket().open(); // opened, then lost before the ack: attempt 1 → [0.5 s, 4 s]
  h.socket().serverClose(1006);
  await h.tick(3_999);
  assert.equal(h.sockets.length, 2);
  await h.tick(1);
  assert.equal(h.sockets.length, 3);
  h.socket().open(); // open but no ack: the subscribe is retried with the next step, [0.5 s, 8 s]
  h.socket().serverClose(1011);
  await h.tick(7_999);
  assert.equal(h.sockets.length, 3);
  await h.tick(1);
  assert.equal(h.sockets.length, 4);
  await h.connect();
  h.socket().serverClose(1006); // after an ack: back to the first step, [0.5 s, 2 s]
  await h.tick(1_999);
  assert.equal(h.sockets.length, 4);
  await h.tick(1);
  assert.equal(h.sockets.length, 5);
  assert.equal(h.tokens.length, 5, "a token on every connect");
});

test("a getToken failure is retried with backoff; null stops the client as unauthorized", async (t) => {
  randomAt(t, 0);
  let answer = Promise.reject(new Error("network"));
  answer.catch(() => {});
  const calls = [];
  const h = setup(t, {
    getToken: async (request) => {
      calls.push(request);
      return answer;
    },
  });
  await h.tick(0);
  assert.equal(h.sockets.length, 0);
  assert.equal(h.client.state, "connecting");
  assert.match(h.logs[0][1], /getToken failed/);
  answer = Promise.resolve(null);
  await h.tick(500);
  assert.equal(calls.length, 2);
  assert.equal(h.client.state, "disconnected");
  assert.deepEqual(h.named("disconnected"), [
    [{ code: 1008, reason: "unauthorized", willReconnect: false, retryIn: null }],
  ]);
  await h.tick(60_000);
  assert.equal(calls.length, 2);
});

test("one getToken at a time: reconnectNow while it runs does not start another", async (t) => {
  let release;
  const calls = [];
  const h = setup(t, {
    getToken: (request) => {
      calls.push(request);
      return new Promise((r) => (release = r));
    },
  });
  await flush();
  h.client.reconnectNow();
  h.client.reconnectNow();
  await flush();
  assert.equal(calls.length, 1);
  release("x.e30.y");
  await flush();
  assert.equal(h.sockets.length, 1, "one socket from the one token");
});

test("1012: back after a random 0–3 s, without a backoff step", async (t) => {
  const random = randomAt(t, 0.5);
  const h = setup(t);
  await h.connect();
  h.socket().serverClose(1012, "server restarting");
  assert.deepEqual(h.named("disconnected"), [
    [{ code: 1012, reason: "server restarting", willReconnect: true, retryIn: 1500 }],
  ]);
  assert.equal(h.client.state, "connecting");
  await h.tick(1_499);
  assert.equal(h.sockets.length, 1);
  await h.tick(1);
  assert.equal(h.sockets.length, 2);
  random.mock.mockImplementation(() => 1);
  h.socket().open();
  h.socket().serverClose(1006); // the attempt count was not raised by the 1012: [0.5 s, 2 s]
  await h.tick(1_999);
  assert.equal(h.sockets.length, 2);
  await h.tick(1);
  assert.equal(h.sockets.length, 3);
});

test("1013: back off with the 5 s floor", async (t) => {
  randomAt(t, 0);
  const h = setup(t);
  await h.connect();
  h.socket().serverClose(1013);
  await h.tick(4_999);
  assert.equal(h.sockets.length, 1);
  await h.tick(1);
  assert.equal(h.sockets.length, 2);
});

test("4008: reconnect and recover from the last position, with a warning", async (t) => {
  randomAt(t, 0);
  const h = setup(t, { games: [{ meta: "chess", id: "g1" }] });
  const socket = await h.connect();
  socket.receive({
    verb: "recovered",
    payload: { stream: "game:chess#g1", recovered: false, epoch: "e1", offset: 2 },
  });
  socket.receive(game(3));
  socket.serverClose(4008, "slow consumer");
  assert.match(h.logs.at(-1)[1], /slow consumer/);
  assert.equal(h.logs.at(-1)[0], "warn");
  await h.tick(500);
  h.socket().open();
  assert.deepEqual(h.socket().sent[0].since["game:chess#g1"], { epoch: "e1", offset: 3 });
});

test("4408: reconnect, logged as a client bug", async (t) => {
  randomAt(t, 0);
  const h = setup(t);
  await h.connect();
  h.socket().serverClose(4408);
  assert.deepEqual(h.logs.at(-1)[0], "error");
  assert.match(h.logs.at(-1)[1], /client bug/);
  await h.tick(500);
  assert.equal(h.sockets.length, 2);
});

test("4509: stop, disconnected, never again", async (t) => {
  const h = setup(t);
  await flush();
  h.socket().open();
  h.socket().receive({
    verb: "error",
    payload: { code: "too_many_connections", message: "20 open", ackId: h.socket().sent[0].ackId },
  });
  h.socket().serverClose(4509, "too many connections");
  assert.equal(h.client.state, "disconnected");
  assert.deepEqual(h.named("disconnected"), [
    [{ code: 4509, reason: "too many connections", willReconnect: false, retryIn: null }],
  ]);
  assert.equal(h.named("error")[0][0].code, "too_many_connections");
  await h.tick(120_000);
  assert.equal(h.sockets.length, 1);
  assert.equal(h.tokens.length, 1);
  h.client.reconnectNow(); // the application may start it again
  await flush();
  assert.equal(h.sockets.length, 2);
});

test("1008: one token refresh, then stop as unauthorized", async (t) => {
  randomAt(t, 0);
  const h = setup(t);
  const refuse = () => {
    const socket = h.socket();
    socket.open();
    socket.receive({
      verb: "error",
      payload: { code: "unauthorized", message: "expired", ackId: socket.sent[0].ackId },
    });
    socket.serverClose(1008, "invalid token");
  };
  await flush();
  refuse();
  assert.equal(h.client.state, "connecting");
  await h.tick(500);
  refuse();
  assert.deepEqual(h.tokens, [{ refresh: false }, { refresh: true }]);
  assert.equal(h.client.state, "disconnected");
  assert.deepEqual(
    h.named("disconnected").map(([d]) => d.willReconnect),
    [true, false],
  );
  await h.tick(120_000);
  assert.equal(h.tokens.length, 2);
});

test("1008: an acknowledged subscribe in between earns another refresh", async (t) => {
  randomAt(t, 0);
  const h = setup(t);
  await h.connect();
  h.socket().serverClose(1008);
  await h.tick(500);
  await h.connect();
  h.socket().serverClose(1008);
  await h.tick(500);
  assert.deepEqual(
    h.tokens.map((r) => r.refresh),
    [false, true, true],
  );
  assert.equal(h.client.state, "connecting");
});

test("1008 after a flood is not a token problem: backoff, no refresh", async (t) => {
  randomAt(t, 0);
  const h = setup(t);
  await h.connect();
  h.socket().receive({ verb: "error", payload: { code: "rate_limited", message: "slow down" } });
  h.socket().serverClose(1008);
  await h.tick(5_000);
  assert.deepEqual(
    h.tokens.map((r) => r.refresh),
    [false, false],
  );
});

test("1001: wait until the page is visible, then reconnect at once", async (t) => {
  const document = Object.assign(new EventTarget(), { visibilityState: "hidden" });
  globalThis.window = new EventTarget();
  globalThis.document = document;
  t.after(() => {
    delete globalThis.window;
    delete globalThis.document;
  });
  const h = setup(t);
  await h.connect();
  h.socket().serverClose(1001);
  await h.tick(120_000);
  assert.equal(h.sockets.length, 1);
  assert.equal(h.client.state, "connecting");
  document.visibilityState = "visible";
  document.dispatchEvent(new Event("visibilitychange"));
  await flush();
  assert.equal(h.sockets.length, 2);
  const socket = await h.connect();
  document.dispatchEvent(new Event("visibilitychange"));
  assert.equal(
    socket.actions("syncPresence").length,
    1,
    "visible again while connected: a fresh snapshot",
  );
});

test("offline drops the socket; online reconnects at once", async (t) => {
  globalThis.window = new EventTarget();
  const navigator = { onLine: true };
  Object.defineProperty(globalThis, "navigator", {
    value: navigator,
    configurable: true,
    writable: true,
  });
  t.after(() => {
    delete globalThis.window;
    delete globalThis.navigator;
  });
  randomAt(t, 0);
  const h = setup(t);
  const socket = await h.connect();
  navigator.onLine = false;
  window.dispatchEvent(new Event("offline"));
  assert.ok(socket.closedByClient);
  assert.deepEqual(h.named("disconnected")[0][0], {
    code: 1006,
    reason: "offline",
    willReconnect: true,
    retryIn: 500,
  });
  await h.tick(60_000);
  assert.equal(h.sockets.length, 1, "no attempts while offline");
  navigator.onLine = true;
  window.dispatchEvent(new Event("online"));
  await flush();
  assert.equal(h.sockets.length, 2);
});

test("a silent socket is replaced after 3 heartbeats; any frame resets the watchdog", async (t) => {
  randomAt(t, 0);
  const h = setup(t);
  const socket = await h.connect({ heartbeatSeconds: 15 });
  await h.tick(44_000);
  socket.receive({ verb: "heartbeat", payload: {} });
  await h.tick(44_999);
  assert.equal(socket.closedByClient, false);
  await h.tick(1);
  assert.ok(socket.closedByClient);
  assert.deepEqual(h.named("disconnected")[0][0], {
    code: 1006,
    reason: "read timeout",
    willReconnect: true,
    retryIn: 500,
  });
  await h.tick(500);
  assert.equal(h.sockets.length, 2);
});

test("timeouts: the connect, and the subscribe's acknowledgement", async (t) => {
  randomAt(t, 0);
  const h = setup(t);
  await h.tick(10_000);
  assert.ok(h.sockets[0].closedByClient, "never opened in 10 s");
  assert.equal(h.named("disconnected")[0][0].reason, "connect timeout");
  await h.tick(5_000); // a socket that never opened: the longer floor
  assert.equal(h.sockets.length, 2);
  h.socket().open();
  await h.tick(14_000);
  h.socket().receive({
    verb: "connections",
    payload: { type: "snapshot", seq: 1, totalCount: 1, visibleUserIds: [] },
  });
  await h.tick(14_999);
  assert.equal(h.sockets[1].closedByClient, false, "frames keep an unacknowledged subscribe alive");
  await h.tick(1);
  assert.ok(h.sockets[1].closedByClient);
  assert.equal(h.named("disconnected")[1][0].reason, "subscribe not acknowledged");
});

test("setGames: sent once, acknowledged, never blindly retried, re-sent in every subscribe", async (t) => {
  randomAt(t, 0);
  const h = setup(t, { games: [{ meta: "chess", id: "g1" }] });
  const socket = await h.connect();
  const done = h.client.setGames([
    { meta: "chess", id: "g1" },
    { meta: "go", id: "g2" },
  ]);
  const [watch] = socket.actions("watchGames");
  assert.deepEqual(watch.games, [
    { meta: "chess", id: "g1" },
    { meta: "go", id: "g2" },
  ]);
  assert.deepEqual(
    watch.since,
    { "game:go#g2": { epoch: "", offset: 0 } },
    "since for the added game only",
  );
  const later = h.client.setGames([{ meta: "go", id: "g2" }]);
  h.client.setGames([{ meta: "go", id: "g3" }]);
  await h.tick(40_000); // under the 45 s read timeout
  assert.equal(
    socket.actions("watchGames").length,
    1,
    "one in flight at a time, no retry by timer",
  );
  let settled = false;
  later.then(() => (settled = true));
  socket.ack();
  await done;
  assert.equal(settled, false, "the later set is not acknowledged yet");
  assert.deepEqual(
    socket.actions("watchGames")[1].games,
    [{ meta: "go", id: "g3" }],
    "only the newest set",
  );
  socket.ack();
  await later;
  await h.client.setGames([{ meta: "go", id: "g3" }]);
  assert.equal(socket.actions("watchGames").length, 2, "the same set again sends nothing");
  socket.serverClose(1006);
  await h.tick(500);
  const next = await h.connect();
  assert.deepEqual(next.sent[0].games, [{ meta: "go", id: "g3" }]);
  assert.equal(next.actions("watchGames").length, 0);
});

test("setGames refused: the promise rejects and the previous set stays", async (t) => {
  randomAt(t, 0);
  const h = setup(t, { games: [{ meta: "chess", id: "g1" }] });
  const socket = await h.connect();
  const refused = h.client.setGames([{ meta: "go", id: "big" }]);
  const { ackId } = socket.actions("watchGames")[0];
  socket.receive({
    verb: "error",
    payload: { code: "too_many_games", message: "at most 1000", ackId },
  });
  await assert.rejects(refused, /too_many_games/);
  socket.serverClose(1006);
  await h.tick(500);
  await flush();
  h.socket().open();
  assert.deepEqual(h.socket().sent[0].games, [{ meta: "chess", id: "g1" }]);
});

test("resync: both the onResync option and .on('resync') are called, once, at the answer", async (t) => {
  const storage = new MemoryStorage();
  storage.setItem("ap-realtime", JSON.stringify({ "game:chess#g1": ["e1", 4] }));
  const fromOption = [];
  const h = setup(t, {
    storage,
    games: [{ meta: "chess", id: "g1" }],
    onResync: (stream, info) => fromOption.push([stream, info]),
  });
  await flush();
  const socket = h.socket();
  socket.open();
  socket.receive({
    verb: "recovered",
    payload: { stream: "game:chess#g1", recovered: false, epoch: "e2", offset: 1 },
  });
  socket.ack();
  assert.equal(fromOption.length, 1);
  assert.deepEqual(h.named("resync"), fromOption);
  assert.deepEqual(fromOption[0][1], {
    stream: "game:chess#g1",
    wasRecovering: true,
    recovered: false,
    replayed: 0,
    reason: "recovery",
    epoch: "e2",
    offset: 1,
  });
  assert.deepEqual(h.named("recovered")[0][0], {
    stream: "game:chess#g1",
    wasRecovering: true,
    recovered: false,
    replayed: 0,
  });
  assert.deepEqual(JSON.parse(storage.getItem("ap-realtime"))["game:chess#g1"], ["e2", 1]);
});

test("events reach their handler exactly once across a reconnect; one verb per event", async (t) => {
  randomAt(t, 0);
  const h = setup(t, { games: [{ meta: "chess", id: "g1" }] });
  await flush();
  let socket = h.socket();
  socket.open();
  socket.receive({
    verb: "recovered",
    payload: { stream: "game:chess#g1", recovered: false, epoch: "e1", offset: 0 },
  });
  socket.receive({ verb: "error", payload: { code: "stream_not_allowed", message: "user:alice" } });
  socket.ack(); // the user stream was not answered: it is live from the ack on
  socket.receive(game(1));
  socket.receive(game(2));
  socket.receive({
    verb: "yourTurn",
    payload: { meta: "chess", id: "g1" },
    stream: "user:alice",
    epoch: "u",
    offset: 1,
  });
  socket.receive({ verb: "pendingTurns", payload: { games: [] } });
  socket.receive({ verb: "test", payload: "hello" });
  socket.serverClose(1006);
  await h.tick(500);
  await flush();
  socket = h.socket();
  socket.open();
  assert.deepEqual(socket.sent[0].since["user:alice"], { epoch: "u", offset: 1 });
  socket.receive(game(2)); // a replay overlapping what was seen
  socket.receive(game(3));
  socket.receive({
    verb: "recovered",
    payload: { stream: "game:chess#g1", recovered: true, epoch: "e1", offset: 3 },
  });
  socket.ack();
  assert.deepEqual(
    h.named("game").map(([, info]) => [info.offset, info.replayed]),
    [
      [1, false],
      [2, false],
      [3, true],
    ],
  );
  assert.equal(h.named("yourTurn").length, 1);
  assert.deepEqual(h.named("pendingTurns")[0][0], { games: [] });
  assert.equal(h.named("test")[0][0], "hello");
  assert.deepEqual(h.named("recovered").at(-1)[0], {
    stream: "game:chess#g1",
    wasRecovering: true,
    recovered: true,
    replayed: 1,
  });
});

test("presence: kept across frames; a gap asks for one snapshot", async (t) => {
  const h = setup(t);
  const socket = await h.connect();
  socket.receive({
    verb: "connections",
    payload: { type: "snapshot", seq: 3, totalCount: 2, visibleUserIds: ["alice", "bob"] },
  });
  socket.receive({
    verb: "connections",
    payload: { type: "delta", seq: 4, joins: ["carol"], leaves: [], totalCount: 3 },
  });
  assert.deepEqual(h.client.presence, {
    seq: 4,
    totalCount: 3,
    visibleUserIds: ["alice", "bob", "carol"],
  });
  socket.receive({
    verb: "connections",
    payload: { type: "delta", seq: 6, joins: [], leaves: ["bob"], totalCount: 2 },
  });
  socket.receive({
    verb: "connections",
    payload: { type: "delta", seq: 7, joins: [], leaves: ["carol"], totalCount: 1 },
  });
  assert.equal(socket.actions("syncPresence").length, 1);
  socket.receive({
    verb: "connections",
    payload: { type: "snapshot", seq: 7, totalCount: 1, visibleUserIds: ["alice"] },
  });
  socket.receive({
    verb: "connections",
    payload: { type: "delta", seq: 9, joins: [], leaves: [] },
  });
  assert.equal(socket.actions("syncPresence").length, 2, "a new gap after the snapshot asks again");
  assert.deepEqual(
    h.named("connections").map(([p]) => p.seq),
    [3, 4, 7],
  );
});

test("setInvisible re-subscribes on the same socket, with a token fetched again", async (t) => {
  const h = setup(t);
  const socket = await h.connect();
  await h.client.setInvisible(true);
  assert.equal(h.tokens.length, 2);
  const [, again] = socket.actions("subscribe");
  assert.equal(again.invisible, true);
  assert.equal(again.since, undefined, "nothing to recover on a live socket");
  assert.equal(h.sockets.length, 1);
  socket.ack({ heartbeatSeconds: 15 });
  assert.equal(h.client.state, "connected");
});

test("close(): disconnected, no reconnect; a throwing handler hurts no other", async (t) => {
  const h = setup(t, { games: [{ meta: "chess", id: "g1" }] });
  const seen = [];
  h.client.on("game", () => {
    throw new Error("app bug");
  });
  const off = h.client.on("game", (payload, info) => seen.push(info.offset));
  const socket = await h.connect();
  socket.receive(game(1));
  off();
  socket.receive(game(2));
  assert.deepEqual(seen, [1]);
  assert.match(h.logs.find(([level]) => level === "error")[1], /"game" handler threw/);
  h.client.close();
  assert.ok(socket.closedByClient);
  assert.equal(h.client.state, "disconnected");
  assert.deepEqual(h.named("disconnected").at(-1)[0], {
    code: 1000,
    reason: "closed by the application",
    willReconnect: false,
    retryIn: null,
  });
  h.client.reconnectNow();
  await h.tick(60_000);
  assert.equal(FakeSocket.instances.length, 1);
});

test("coalesce: a replayed burst reaches the page as one call", async (t) => {
  const storage = new MemoryStorage();
  storage.setItem("ap-realtime", JSON.stringify({ "game:chess#g1": ["e1", 0] }));
  const h = setup(t, { storage, games: [{ meta: "chess", id: "g1" }], coalesce: ["game"] });
  await flush();
  const socket = h.socket();
  socket.open();
  for (let offset = 1; offset <= 50; offset++) socket.receive(game(offset));
  socket.receive({
    verb: "recovered",
    payload: { stream: "game:chess#g1", recovered: true, epoch: "e1", offset: 50 },
  });
  socket.ack();
  const calls = h.named("game");
  assert.equal(calls.length, 1);
  assert.equal(calls[0][1].batch.length, 50);
  assert.equal(h.named("recovered")[0][0].replayed, 50);
});

test("a getToken that throws at once is a temporary failure, not a crash", async (t) => {
  randomAt(t, 0);
  let calls = 0;
  const h = setup(t, {
    getToken: (request) => {
      calls++;
      if (calls === 1) throw new Error("not async");
      return Promise.resolve(h.tokens.push(request) && "x.e30.y");
    },
  });
  await h.tick(0);
  assert.equal(h.sockets.length, 0);
  await h.tick(500);
  assert.equal(h.sockets.length, 1);
});

test("setGames while away settles at the next subscribe's ack, which carries the set", async (t) => {
  randomAt(t, 0);
  const h = setup(t, { games: [{ meta: "chess", id: "g1" }] });
  const socket = await h.connect();
  socket.serverClose(1006);
  let settled = false;
  const done = h.client.setGames([{ meta: "go", id: "g2" }]).then(() => (settled = true));
  await h.tick(0);
  assert.equal(settled, false);
  await h.tick(500);
  await flush();
  const next = h.socket();
  next.open();
  assert.deepEqual(next.sent[0].games, [{ meta: "go", id: "g2" }]);
  assert.equal(settled, false, "not before the server says so");
  next.ack();
  await done;
  assert.equal(next.actions("watchGames").length, 0);
});

test("close() after a stop reports nothing more", async (t) => {
  const h = setup(t);
  await flush();
  h.socket().open();
  h.socket().serverClose(4509);
  h.client.close();
  assert.equal(h.named("disconnected").length, 1);
});

test("setInvisible while the subscribe is in flight re-subscribes after its ack", async (t) => {
  const h = setup(t);
  await flush();
  const socket = h.socket();
  socket.open();
  assert.equal(socket.actions("subscribe")[0].invisible, false);
  await h.client.setInvisible(true);
  assert.equal(socket.actions("subscribe").length, 1, "not before the first is acknowledged");
  socket.ack({ heartbeatSeconds: 15 });
  await flush();
  const again = socket.actions("subscribe");
  assert.deepEqual(
    again.map((m) => m.invisible),
    [false, true],
  );
  socket.ack({ heartbeatSeconds: 15 });
  await flush();
  await h.client.setInvisible(true);
  assert.equal(socket.actions("subscribe").length, 2, "the same flag again sends nothing");
});

test("a disconnected listener may close the client", async (t) => {
  randomAt(t, 0);
  const h = setup(t);
  await h.connect();
  h.client.on("disconnected", () => h.client.close());
  h.socket().serverClose(1006);
  assert.equal(h.client.state, "disconnected");
  await h.tick(60_000);
  assert.equal(h.sockets.length, 1, "closed in the listener: no reconnect");
});

test("a disconnected listener may reconnect at once, skipping the wait", async (t) => {
  randomAt(t, 0);
  const h = setup(t);
  await h.connect();
  h.client.on("disconnected", ({ willReconnect }) => willReconnect && h.client.reconnectNow());
  h.socket().serverClose(1013);
  await flush();
  assert.equal(h.sockets.length, 2, "no 5 s wait");
  await h.connect();
  await h.tick(40_000);
  assert.equal(h.sockets.length, 2, "and no second attempt from the abandoned wait");
});

test("1001 while hidden reports no retry time: it waits for the page", async (t) => {
  globalThis.window = new EventTarget();
  globalThis.document = Object.assign(new EventTarget(), { visibilityState: "hidden" });
  t.after(() => {
    delete globalThis.window;
    delete globalThis.document;
  });
  const h = setup(t);
  await h.connect();
  h.socket().serverClose(1001, "idle");
  assert.deepEqual(h.named("disconnected")[0][0], {
    code: 1001,
    reason: "idle",
    willReconnect: true,
    retryIn: null,
  });
});
