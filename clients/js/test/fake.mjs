// A scripted WebSocket and the plumbing to drive RealtimeClient under mocked timers.
import { RealtimeClient } from "../build/lib/client.js";

export class FakeSocket {
  static instances = [];

  constructor(url) {
    this.url = url;
    this.readyState = 0;
    this.sent = [];
    this.closedByClient = false;
    FakeSocket.instances.push(this);
  }

  send(data) {
    this.sent.push(JSON.parse(data));
  }

  close() {
    this.readyState = 3;
    this.closedByClient = true;
  }

  open() {
    this.readyState = 1;
    this.onopen?.({});
  }

  receive(frame) {
    this.onmessage?.({ data: JSON.stringify(frame) });
  }

  serverClose(code, reason = "") {
    this.readyState = 3;
    this.onclose?.({ code, reason });
  }

  actions(name) {
    return this.sent.filter((m) => m.action === name);
  }

  /** Acknowledge the last frame that asked for it. */
  ack(extra = {}) {
    const asked = this.sent.filter((m) => m.ackId).at(-1);
    this.receive({ verb: "ack", payload: { ackId: asked.ackId, action: asked.action, ...extra } });
  }
}

export class MemoryStorage {
  items = new Map();
  getItem(key) {
    return this.items.has(key) ? this.items.get(key) : null;
  }
  setItem(key, value) {
    this.items.set(key, String(value));
  }
}

export const tokenFor = (sub) =>
  `eyJhbGciOiJIUzI1NiJ9.${Buffer.from(JSON.stringify({ sub, exp: 2e9 })).toString("base64url")}.sig`;

export const flush = () => new Promise((resolve) => setImmediate(resolve));

const RECORDED = [
  "state",
  "connected",
  "disconnected",
  "resync",
  "recovered",
  "connections",
  "game",
  "chat",
  "yourTurn",
  "notification",
  "challenge",
  "pendingTurns",
  "error",
  "test",
];

/** A client on fake sockets and mocked timers; every event it emits is recorded in order. */
export function setup(t, options = {}) {
  t.mock.timers.enable({ apis: ["setTimeout"] });
  FakeSocket.instances = [];
  const tokens = [];
  const logs = [];
  const events = [];
  const storage = options.storage ?? new MemoryStorage();
  const client = new RealtimeClient({
    url: "ws://node/",
    getToken: async (request) => {
      tokens.push(request);
      return tokenFor("alice");
    },
    WebSocket: FakeSocket,
    storage,
    logger: {
      warn: (...args) => logs.push(["warn", args.join(" ")]),
      error: (...args) => logs.push(["error", args.join(" ")]),
    },
    ...options,
  });
  for (const name of RECORDED) client.on(name, (...args) => events.push([name, ...args]));
  t.after(() => client.close());
  const h = {
    client,
    tokens,
    logs,
    events,
    storage,
    sockets: FakeSocket.instances,
    socket: () => FakeSocket.instances.at(-1),
    named: (name) => events.filter((e) => e[0] === name).map((e) => e.slice(1)),
    async tick(ms) {
      await flush();
      t.mock.timers.tick(ms);
      await flush();
    },
    /** Open the newest socket and acknowledge its subscribe. */
    async connect(ack = { heartbeatSeconds: 15 }) {
      await flush();
      const socket = h.socket();
      socket.open();
      socket.ack(ack);
      return socket;
    },
  };
  return h;
}
