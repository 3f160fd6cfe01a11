// The browser client: one socket, reconnects by the close-code policy, recovery by position.

import {
  backoffDelay,
  closePlan,
  OVERLOAD_MIN_MS,
  RESTART_SPREAD_MS,
  type Plan,
  type Wait,
} from "./policy.js";
import { applyPresence, type Presence, type PresenceMessage } from "./presence.js";
import {
  Positions,
  Streams,
  type EventInfo,
  type RecoveryInfo,
  type ResyncInfo,
  type StorageLike,
  type StreamFrame,
} from "./streams.js";

export type State = "disconnected" | "connecting" | "connected";

export interface GameRef {
  meta: string;
  id: string;
}

export interface DisconnectInfo {
  /** The close code; 1006 when the socket died or was given up without one. */
  code: number;
  reason: string;
  willReconnect: boolean;
  /** Milliseconds until the next attempt; null when it waits for the page (visible, online). */
  retryIn: number | null;
}

export interface ServerError {
  code: string;
  message: string;
  ackId?: string;
  clientMsgId?: string;
}

export interface ClientOptions {
  /** The server's address, or a function giving it at each connect. */
  url: string | (() => string);
  /**
   * Called before every connect, one call at a time. A string is the token; null or
   * undefined means "not signed in" and stops the client; a rejection is a temporary
   * failure and is retried with backoff. `refresh` is true once after a 1008: return a
   * freshly issued token then.
   */
  getToken: (request: { refresh: boolean }) => Promise<string | null | undefined>;
  /** The games to watch from the first subscribe on (see `setGames`). */
  games?: GameRef[];
  /** Where positions live: any Web Storage-like object; default sessionStorage, else memory. */
  storage?: StorageLike | null;
  /** The key under which positions are stored (default "ap-realtime"). */
  storageKey?: string;
  invisible?: boolean;
  /** Ask for presence frames (default true; bots usually say false). */
  wantsPresence?: boolean;
  /** Verbs whose replayed bursts reach the handler as one call per stream, e.g. ["game"]. */
  coalesce?: string[];
  /** The same as `.on("resync", fn)`. */
  onResync?: (stream: string, info: ResyncInfo) => void;
  /** From `new WebSocket` to open (default 10 s). */
  connectTimeoutMs?: number;
  /** From subscribe to its acknowledgement, with no frame at all in between (default 15 s). */
  ackTimeoutMs?: number;
  /** Silence after which a subscribed socket is replaced (default 3 × the server heartbeat). */
  readTimeoutMs?: number;
  /** A WebSocket class, where there is no global one (Node before 22, tests). */
  WebSocket?: new (url: string) => WebSocket;
  /** Where warnings go (default console). */
  logger?: Pick<Console, "warn" | "error">;
}

type Handler = (...args: any[]) => void;

/** The listener signatures of the named events; any other verb gets `(payload, info)`. */
export interface Events {
  state: (state: State) => void;
  connected: () => void;
  disconnected: (info: DisconnectInfo) => void;
  resync: (stream: string, info: ResyncInfo) => void;
  recovered: (info: RecoveryInfo) => void;
  connections: (presence: Presence, message: PresenceMessage) => void;
  pendingTurns: (payload: { games: GameRef[] }, info: EventInfo) => void;
  error: (error: ServerError) => void;
  game: (payload: GameRef & Record<string, unknown>, info: EventInfo) => void;
  chat: (payload: GameRef & Record<string, unknown>, info: EventInfo) => void;
  yourTurn: (payload: any, info: EventInfo) => void;
  challenge: (payload: any, info: EventInfo) => void;
  notification: (payload: any, info: EventInfo) => void;
}

const gameStream = (g: GameRef) => `game:${g.meta}#${g.id}`;
const keyOf = (games: GameRef[]) => games.map(gameStream).sort().join("\n");
const valid = (s: unknown) => typeof s === "string" && s.length > 0 && s.length <= 128;

/** The user id a token names (its `sub`), for the user stream's position. */
function subject(token: string): string | undefined {
  try {
    return JSON.parse(atob(token.split(".")[1]!.replace(/-/g, "+").replace(/_/g, "/"))).sub;
  } catch {
    return undefined;
  }
}

function defaultStorage(): StorageLike | null {
  try {
    return globalThis.sessionStorage ?? null;
  } catch {
    return null; // a sandboxed frame forbids it
  }
}

export class RealtimeClient {
  private _state: State = "connecting";
  /** The presence state, from the last snapshot and the deltas after it. */
  presence: Presence | null = null;
  private readonly o: ClientOptions;
  private readonly streams: Streams;
  private readonly listeners = new Map<string, Set<Handler>>();
  private ws: WebSocket | null = null;
  private opened = false;
  private lastError: string | undefined;
  private generation = 0;
  private attempt = 0;
  private refreshed = false;
  private refreshNext = false;
  private stopped = false;
  private closed = false;
  private waiting: "visible" | "online" | null = null;
  private timer: ReturnType<typeof setTimeout> | undefined;
  private watchdog: ReturnType<typeof setTimeout> | undefined;
  private readMs = 0;
  private token: string | null = null;
  private tokenCall: Promise<string | null | undefined> | null = null;
  private acks = 0;
  private subscribeAck: string | null = null;
  /** How many `setGames` callers (the oldest) the pending subscribe answers. */
  private covers = 0;
  /** The streams the pending subscribe recovers: all answered by its ack. */
  private begun: string[] = [];
  private watchAck: { id: string; previous: GameRef[]; added: string[]; covers: number } | null =
    null;
  private desired: GameRef[];
  private held: GameRef[] = [];
  private waiters: Array<[() => void, (error: Error) => void]> = [];
  private syncing = false;
  private invisible: boolean;
  private sentInvisible = false;
  private readonly unlisten: Array<() => void> = [];

  constructor(options: ClientOptions) {
    this.o = options;
    this.desired = clean(options.games ?? []);
    this.invisible = !!options.invisible;
    const storage = options.storage === undefined ? defaultStorage() : options.storage;
    this.streams = new Streams(
      new Positions(storage, options.storageKey ?? "ap-realtime"),
      new Set(options.coalesce ?? []),
      {
        deliver: (verb, payload, info) => this.emit(verb, payload, info),
        resync: (stream, info) => this.emit("resync", stream, info),
        recovered: (info) => this.emit("recovered", info),
      },
    );
    if (options.onResync) this.on("resync", options.onResync);
    const target = globalThis.window as Window | undefined;
    if (target) {
      const listen = (on: EventTarget, name: string, fn: () => void) => {
        on.addEventListener(name, fn);
        this.unlisten.push(() => on.removeEventListener(name, fn));
      };
      listen(target, "online", () => this.wake("online"));
      listen(target, "offline", () => this.ws && this.giveUp("offline", "backoff"));
      if (globalThis.document) {
        listen(document, "visibilitychange", () => {
          if (hidden()) return;
          if (this._state === "connected") this.send({ action: "syncPresence" });
          else this.wake("visible");
        });
      }
    }
    void this.connect();
  }

  /** `disconnected` only once stopped: by 4509, by "unauthorized", or by `close()`. */
  get state(): State {
    return this._state;
  }

  on<K extends keyof Events>(verb: K, fn: Events[K]): () => void;
  on<V extends string>(
    verb: V extends keyof Events ? never : V,
    fn: (payload: any, info: EventInfo) => void,
  ): () => void;
  on(verb: string, fn: Handler): () => void {
    let set = this.listeners.get(verb);
    if (!set) this.listeners.set(verb, (set = new Set()));
    set.add(fn);
    return () => set.delete(fn);
  }

  /**
   * Watch exactly `games`. Sent once now (or with the next subscribe), re-sent after every
   * reconnect. Settles when the server acknowledges this set or a later one; rejects when it
   * refuses it (the previous set then stays, here and on the server).
   */
  setGames(games: GameRef[]): Promise<void> {
    this.desired = clean(games);
    const settled = new Promise<void>((resolve, reject) => this.waiters.push([resolve, reject]));
    settled.catch(() => {}); // the `error` event reports it too: no unhandled rejection
    this.syncGames();
    return settled;
  }

  /** Change the invisible flag on the open socket (a re-subscribe), not by reconnecting. */
  setInvisible(invisible: boolean): Promise<void> {
    this.invisible = invisible;
    return this.syncFlags();
  }

  /** Reconnect at once: a running client drops its socket, a stopped one starts again. */
  reconnectNow(): void {
    if (this.closed) return;
    this.stopped = false;
    this.refreshed = false;
    // The backoff step stays: it resets only once a subscribe is acknowledged.
    if (this.ws) this.giveUp("reconnectNow", null);
    void this.connect();
  }

  /** Stop for good: close the socket and forget the listeners on the page. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    for (const off of this.unlisten) off();
    if (!this.stopped) this.stop(1000, "closed by the application");
  }

  // --- connecting -----------------------------------------------------------

  private async connect(): Promise<void> {
    clearTimeout(this.timer);
    this.timer = undefined;
    this.waiting = null;
    if (this.stopped || this.ws) return;
    if (globalThis.navigator?.onLine === false) {
      this.waiting = "online";
      return;
    }
    const generation = ++this.generation;
    this.setState("connecting");
    let token: string | null | undefined;
    try {
      token = await this.fetchToken(this.refreshNext);
    } catch (error) {
      if (generation !== this.generation || this.stopped) return;
      this.log("warn", "getToken failed, retrying", error);
      return this.retry("backoff");
    }
    if (generation !== this.generation || this.stopped) return;
    this.refreshNext = false;
    if (!token) return this.stop(1008, "unauthorized");
    this.token = token;
    const url = typeof this.o.url === "function" ? this.o.url() : this.o.url;
    let ws: WebSocket;
    try {
      ws = new (this.o.WebSocket ?? WebSocket)(url);
    } catch (error) {
      this.log("error", "cannot open a socket", error);
      return this.stop(1006, "bad url");
    }
    this.ws = ws;
    this.opened = false;
    this.lastError = undefined;
    this.arm(this.o.connectTimeoutMs ?? 10_000, "connect timeout");
    ws.onopen = () => {
      this.opened = true;
      this.subscribe(true);
    };
    ws.onmessage = (event) => this.receive(event.data);
    ws.onclose = (event) => {
      const plan = closePlan({
        code: event.code,
        opened: this.opened,
        error: this.lastError,
        refreshed: this.refreshed,
      });
      this.drop();
      this.after(event.code, event.reason, plan);
    };
  }

  /** One getToken call at a time: a caller during a call shares its answer. */
  private fetchToken(refresh: boolean): Promise<string | null | undefined> {
    return (this.tokenCall ??= new Promise<string | null | undefined>((resolve) =>
      resolve(this.o.getToken({ refresh })),
    ).finally(() => {
      this.tokenCall = null;
    }));
  }

  /** Re-subscribe when the flag differs from the one the server holds (after any pending subscribe). */
  private async syncFlags(): Promise<void> {
    const ready = () =>
      this._state === "connected" && !this.subscribeAck && this.sentInvisible !== this.invisible;
    if (!ready()) return; // a pending subscribe's ack, or the next subscribe, comes back here
    const ws = this.ws;
    const token = await this.fetchToken(false).catch(() => null);
    if (token && ws === this.ws && ready()) {
      this.token = token;
      this.subscribe(false);
    }
  }

  private subscribe(recover: boolean): void {
    const id = (this.subscribeAck = `s${++this.acks}`);
    this.sentInvisible = this.invisible;
    this.held = this.desired;
    this.covers = this.waiters.length;
    const sub = this.token && subject(this.token);
    const streams = recover ? this.held.map(gameStream) : [];
    if (sub && recover) streams.push(`user:${sub}`);
    this.begun = streams;
    this.send({
      action: "subscribe",
      token: this.token,
      invisible: this.invisible,
      ...(this.o.wantsPresence === false && { wantsPresence: false }),
      watchVersion: 1,
      games: this.held,
      ...(recover && { since: this.streams.begin(streams) }),
      heartbeat: true,
      ackId: id,
    });
    this.arm(this.o.ackTimeoutMs ?? 15_000, "subscribe not acknowledged");
  }

  private syncGames(): void {
    if (this._state !== "connected" || this.watchAck || this.subscribeAck) return;
    if (keyOf(this.desired) === keyOf(this.held)) return this.settle(null);
    const id = `w${++this.acks}`;
    const before = new Set(this.held.map(gameStream));
    const added = this.desired.map(gameStream).filter((s) => !before.has(s));
    this.watchAck = { id, previous: this.held, added, covers: this.waiters.length };
    this.held = this.desired;
    this.send({
      action: "watchGames",
      games: this.held,
      since: this.streams.begin(added),
      ackId: id,
    });
  }

  /** Settle the `count` oldest `setGames` callers (all by default). */
  private settle(error: Error | null, count = this.waiters.length): void {
    for (const [resolve, reject] of this.waiters.splice(0, count))
      error ? reject(error) : resolve();
  }

  // --- frames ---------------------------------------------------------------

  private receive(data: unknown): void {
    if (this.subscribeAck) this.arm(this.o.ackTimeoutMs ?? 15_000, "subscribe not acknowledged");
    else this.arm(this.readMs, "read timeout");
    let frame: { verb?: string; payload?: any; stream?: string };
    try {
      frame = JSON.parse(data as string);
    } catch {
      return this.log("warn", "unreadable frame", data);
    }
    const { verb, payload } = frame;
    if (verb === "heartbeat" || typeof verb !== "string") return;
    if (verb === "ack") return this.acked(payload);
    if (verb === "error") return this.refused(payload);
    if (verb === "recovered") return this.streams.answer(payload);
    if (verb === "connections") {
      const { presence, gap } = applyPresence(this.presence, payload);
      if (payload.type === "snapshot") this.syncing = false;
      if (gap && !this.syncing) {
        this.syncing = true;
        this.send({ action: "syncPresence" });
      }
      if (presence && presence !== this.presence)
        this.emit(verb, (this.presence = presence), payload);
      return;
    }
    if (typeof frame.stream === "string") return this.streams.frame(frame as StreamFrame);
    this.emit(verb, payload, { replayed: false, batch: [payload] });
  }

  private acked(payload: { ackId?: string; heartbeatSeconds?: number }): void {
    if (payload.ackId === this.subscribeAck) {
      this.subscribeAck = null;
      this.streams.drop(this.begun); // any left unanswered were refused (stream_not_allowed)
      this.settle(null, this.covers);
      this.attempt = 0;
      this.refreshed = false;
      this.readMs = this.o.readTimeoutMs ?? (payload.heartbeatSeconds ?? 0) * 3000;
      this.arm(this.readMs, "read timeout");
      if (this._state !== "connected") {
        this.setState("connected");
        this.emit("connected");
      }
      void this.syncFlags();
    } else if (this.watchAck && payload.ackId === this.watchAck.id) {
      this.streams.drop(this.watchAck.added);
      this.settle(null, this.watchAck.covers);
      this.watchAck = null;
    } else return;
    this.syncGames();
  }

  private refused(error: ServerError): void {
    this.lastError = error.code;
    this.emit("error", error);
    const watch = this.watchAck;
    if (watch && error.ackId === watch.id) {
      // Refused as a whole: the server keeps the previous set, and so do we.
      this.watchAck = null;
      this.streams.drop(watch.added);
      this.settle(new Error(`${error.code}: ${error.message}`), watch.covers);
      if (keyOf(this.desired) === keyOf(this.held)) this.desired = watch.previous;
      this.held = watch.previous;
      this.syncGames(); // a set asked for since then
    } else if (error.ackId === this.subscribeAck && error.code === "too_many_games") {
      // Subscribed with no games; the ack follows.
      this.settle(new Error(`${error.code}: ${error.message}`), this.covers);
      this.covers = 0;
      if (keyOf(this.desired) === keyOf(this.held)) this.desired = [];
      this.held = [];
    } else if (error.ackId === this.subscribeAck && error.code === "invalid_message") {
      this.log("error", "client bug: the server refused the subscribe", error);
    }
  }

  // --- losing the socket ----------------------------------------------------

  /** Give up the socket ourselves (no close frame from the server: 1006). */
  private giveUp(reason: string, wait: Wait | null): void {
    this.drop();
    if (wait) this.after(1006, reason, { stop: false, wait });
    else this.emit("disconnected", { code: 1006, reason, willReconnect: true, retryIn: 0 });
  }

  /** Forget the socket and everything tied to it. */
  private drop(): void {
    const ws = this.ws;
    clearTimeout(this.watchdog);
    this.ws = null;
    this.readMs = 0;
    this.subscribeAck = null;
    this.syncing = false;
    if (this.watchAck) {
      this.streams.drop(this.watchAck.added);
      this.watchAck = null;
    }
    this.streams.reset();
    if (ws) {
      ws.onopen = ws.onmessage = ws.onclose = null;
      if (ws.readyState < 2) ws.close();
    }
  }

  private after(code: number, reason: string, plan: Plan): void {
    if (plan.log)
      this.log(plan.bug ? "error" : "warn", (plan.bug ? "client bug: " : "") + plan.log);
    if (plan.stop) return this.stop(code, reason);
    this.retry(plan.wait ?? "backoff", code, reason);
  }

  /** Wait as `wait` says, then connect; `code` and `reason` are reported first, if given. */
  private retry(wait: Wait, code?: number, reason = ""): void {
    if (wait === "refresh") this.refreshed = this.refreshNext = true;
    const delay =
      wait === "visible" && hidden()
        ? null
        : wait === "restart"
          ? Math.random() * RESTART_SPREAD_MS
          : backoffDelay(this.attempt++, wait === "overload" ? OVERLOAD_MIN_MS : undefined);
    const generation = this.generation;
    if (code !== undefined) {
      this.emit("disconnected", { code, reason, willReconnect: true, retryIn: delay });
      // A listener may have called close() or reconnectNow(): then that is what happens.
      if (this.stopped || generation !== this.generation) return;
    }
    this.setState("connecting");
    if (delay === null) this.waiting = "visible";
    else this.timer = setTimeout(() => void this.connect(), delay);
  }

  /** The page is back (visible, online): skip what is left of the wait. */
  private wake(cause: "visible" | "online"): void {
    if (this.stopped || this.ws) return;
    if (this.waiting === cause || this.timer !== undefined) void this.connect();
  }

  private stop(code: number, reason: string): void {
    this.stopped = true;
    this.generation++;
    clearTimeout(this.timer);
    this.timer = undefined;
    this.drop();
    this.settle(new Error("stopped"));
    this.setState("disconnected");
    this.emit("disconnected", { code, reason, willReconnect: false, retryIn: null });
  }

  // --- plumbing -------------------------------------------------------------

  /** (Re)start the watchdog: no frame within `ms` replaces the socket. */
  private arm(ms: number, reason: string): void {
    clearTimeout(this.watchdog);
    // A socket that never opened may be a refused upgrade: the longer floor, as for a 503.
    if (ms > 0)
      this.watchdog = setTimeout(
        () => this.giveUp(reason, this.opened ? "backoff" : "overload"),
        ms,
      );
  }

  private send(message: object): void {
    if (this.ws?.readyState === 1) this.ws.send(JSON.stringify(message));
  }

  private setState(state: State): void {
    if (state === this._state) return;
    this._state = state;
    this.emit("state", state);
  }

  private emit(verb: string, ...args: unknown[]): void {
    for (const fn of [...(this.listeners.get(verb) ?? [])]) {
      try {
        fn(...args);
      } catch (error) {
        this.log("error", `a "${verb}" handler threw`, error);
      }
    }
  }

  private log(level: "warn" | "error", ...args: unknown[]): void {
    (this.o.logger ?? console)[level]("realtime:", ...args);
  }
}

function hidden(): boolean {
  return globalThis.document?.visibilityState === "hidden";
}

/** The refs the server accepts, each once (it would refuse the whole set otherwise). */
function clean(games: GameRef[]): GameRef[] {
  const seen = new Map<string, GameRef>();
  for (const g of games) {
    if (valid(g?.meta) && valid(g.id) && !g.meta.includes("#"))
      seen.set(gameStream(g), { meta: g.meta, id: g.id });
  }
  return [...seen.values()];
}
