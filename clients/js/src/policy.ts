// What to do after a socket closes, and how long to wait: pure, so every case is unit-tested.

/** Backoff floor and ceiling for ordinary failures. */
export const BACKOFF_MIN_MS = 500;
export const BACKOFF_MAX_MS = 30_000;
/** The floor when the server said it is overloaded (1013, or an upgrade refused). */
export const OVERLOAD_MIN_MS = 5_000;
/** A drained node (1012) asks everyone back at once: spread them over this window. */
export const RESTART_SPREAD_MS = 3_000;
/** The first step's ceiling at least: a dead node's clients all fail at once, and
 *  their first retries spread over 1.5 s reach the others at a pace they admit. */
export const FIRST_CEILING_MS = 2_000;

/**
 * Exponential backoff with full jitter: uniform over
 * [min, min(max, max(2·min, FIRST_CEILING_MS)·2^attempt)], where `attempt` counts the
 * failures since the last acknowledged subscribe, from 0: 0.5–2 s, 0.5–4 s, … 0.5–30 s.
 */
export function backoffDelay(
  attempt: number,
  min: number = BACKOFF_MIN_MS,
  max: number = BACKOFF_MAX_MS,
  random: () => number = Math.random,
): number {
  const first = Math.max(2 * min, FIRST_CEILING_MS);
  const ceiling = Math.min(max, first * 2 ** Math.min(attempt, 16));
  return min + random() * (Math.max(ceiling, min) - min);
}

/**
 * How the next attempt waits:
 * - `restart`: a random 0–3 s, no backoff step (the node is draining, the cluster is fine);
 * - `backoff`: the next backoff step;
 * - `overload`: the next backoff step with the longer floor;
 * - `refresh`: the next backoff step, with a forced token refresh;
 * - `visible`: wait until the page is visible, then as `backoff`.
 */
export type Wait = "restart" | "backoff" | "overload" | "refresh" | "visible";

export interface Plan {
  stop: boolean;
  /** How to wait, unless stopping. */
  wait?: Wait;
  /** What to tell the console. */
  log?: string;
  /** The close points to a bug in the client, not in the network or the server. */
  bug?: boolean;
}

export interface Closed {
  /** The close code (1006 when the socket died without one). */
  code: number;
  /** Whether the socket ever opened: a browser cannot see an HTTP 503, only a socket that never opened. */
  opened: boolean;
  /** The code of the last error frame on this socket, which says why a 1008 came. */
  error?: string | undefined;
  /** Whether this run of 1008s already had its one token refresh. */
  refreshed: boolean;
}

export function closePlan({ code, opened, error, refreshed }: Closed): Plan {
  if (code === 4509) return { stop: true, log: "too many connections for this user: stopped" };
  if (code === 1008) {
    if (error === "rate_limited") {
      return {
        stop: false,
        wait: "overload",
        bug: true,
        log: "closed for flooding the server (1008 rate_limited)",
      };
    }
    if (refreshed) return { stop: true, log: "unauthorized after a token refresh: stopped" };
    return { stop: false, wait: "refresh" };
  }
  if (code === 1012) return { stop: false, wait: "restart" };
  if (code === 1013 || !opened) return { stop: false, wait: "overload" };
  if (code === 4008) {
    return {
      stop: false,
      wait: "backoff",
      log: "closed as a slow consumer (4008): reconnecting and recovering",
    };
  }
  if (code === 4408) {
    return {
      stop: false,
      wait: "backoff",
      bug: true,
      log: "no subscribe within the server's timeout (4408)",
    };
  }
  if (code === 1001) return { stop: false, wait: "visible" };
  return { stop: false, wait: "backoff" };
}
