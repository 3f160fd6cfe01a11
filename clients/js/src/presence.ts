// Presence kept as the live client keeps it: a snapshot replaces, deltas apply in seq order.

export interface Presence {
  seq: number;
  totalCount: number;
  visibleUserIds: string[];
}

export interface PresenceSnapshot {
  type: "snapshot";
  seq: number;
  totalCount: number;
  visibleUserIds: string[];
}

export interface PresenceDelta {
  type: "delta";
  seq: number;
  joins: string[];
  leaves: string[];
  /** The count after the delta (servers that send it are exact; older ones are not). */
  totalCount?: number;
}

export type PresenceMessage = PresenceSnapshot | PresenceDelta;

/**
 * The presence after `message`, and whether a gap was seen (the caller then asks for a
 * snapshot with `syncPresence`). A delta at or below the current seq changes nothing.
 */
export function applyPresence(
  current: Presence | null,
  message: PresenceMessage,
): { presence: Presence | null; gap: boolean } {
  if (message.type === "snapshot") {
    return {
      presence: {
        seq: message.seq,
        totalCount: message.totalCount,
        visibleUserIds: [...message.visibleUserIds],
      },
      gap: false,
    };
  }
  if (current === null) return { presence: null, gap: true };
  if (message.seq <= current.seq) return { presence: current, gap: false };
  if (message.seq > current.seq + 1) return { presence: current, gap: true };
  const visible = new Set(current.visibleUserIds);
  for (const user of message.leaves) visible.delete(user);
  for (const user of message.joins) visible.add(user);
  return {
    presence: {
      seq: message.seq,
      totalCount:
        message.totalCount ??
        Math.max(0, current.totalCount + message.joins.length - message.leaves.length),
      visibleUserIds: [...visible],
    },
    gap: false,
  };
}
