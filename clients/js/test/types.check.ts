// Compiled by `tsc -p test/tsconfig.json` against the shipped declarations: how an
// application uses the client, and the misuses the types must refuse.
import {
  RealtimeClient,
  type EventInfo,
  type Presence,
  type ResyncInfo,
  type State,
} from "../dist/types/index.js";

const client = new RealtimeClient({
  url: () => "wss://ws.example/",
  getToken: async ({ refresh }) => (refresh ? "fresh" : "cached"),
  games: [{ meta: "chess", id: "g1" }],
  storage: { getItem: () => null, setItem: () => {} },
  coalesce: ["game"],
  onResync: (stream: string, info: ResyncInfo) => void [stream, info.reason, info.epoch],
});

const state: State = client.state;
const presence: Presence | null = client.presence;
const off: () => void = client.on("game", (payload, info: EventInfo) => {
  const meta: string = payload.meta;
  const all: unknown[] = info.batch;
  void [meta, all, info.replayed];
});
client.on(
  "disconnected",
  ({ code, reason, willReconnect }) => void [code + 1, reason.length, !willReconnect],
);
client.on(
  "recovered",
  ({ stream, wasRecovering, recovered, replayed }) =>
    void [stream, wasRecovering, recovered, replayed + 1],
);
client.on("connections", (now) => void now.visibleUserIds.map((user) => user.length));
client.on("pendingTurns", ({ games }) => void games.map((g) => g.id));
client.on("gameEnd", (payload, info) => void [payload, info.stream]);
const settled: Promise<void> = client.setGames([{ meta: "go", id: "g2" }]);
client.setInvisible(true);
client.reconnectNow();
client.close();
void [state, presence, off, settled];

// @ts-expect-error: the URL is required
new RealtimeClient({ getToken: async () => "t" });
// @ts-expect-error: getToken returns a promise of a token
new RealtimeClient({ url: "wss://x/", getToken: () => 42 });
const halfStorage = { getItem: () => null };
// @ts-expect-error: storage needs getItem and setItem
new RealtimeClient({ url: "wss://x/", getToken: async () => "t", storage: halfStorage });
// @ts-expect-error: a state is one of three strings
client.on("state", (s: number) => s);
// @ts-expect-error: a game ref has meta and id
void client.setGames([{ meta: "chess" }]);
// @ts-expect-error: state is read-only
client.state = "connected";
