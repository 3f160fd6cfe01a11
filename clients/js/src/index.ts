export { RealtimeClient } from "./client.js";
export type {
  ClientOptions,
  DisconnectInfo,
  Events,
  GameRef,
  ServerError,
  State,
} from "./client.js";
export type { Presence, PresenceDelta, PresenceMessage, PresenceSnapshot } from "./presence.js";
export type { EventInfo, Position, RecoveryInfo, ResyncInfo, StorageLike } from "./streams.js";
