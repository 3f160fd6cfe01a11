// Stream positions, recovery answers, duplicates, gaps and coalesced replays: no I/O.

/** A place in a stream: the last offset seen within an epoch ("" and 0: none yet). */
export interface Position {
  epoch: string;
  offset: number;
}

/** The Web Storage interface, or anything with these two methods. */
export interface StorageLike {
  getItem(key: string): string | null;
  setItem(key: string, value: string): void;
}

/** A positioned frame as the server sends it (`skip` frames have no payload). */
export interface StreamFrame {
  verb: string;
  payload?: unknown;
  stream: string;
  epoch: string;
  offset: number;
}

/** Passed with every stream event: where it sits, and the frames this one call stands for. */
export interface EventInfo {
  stream?: string;
  epoch?: string;
  offset?: number;
  /** True when the event came in a recovery replay rather than live. */
  replayed: boolean;
  /** Every payload this call carries, oldest first: one, or a coalesced replay burst. */
  batch: unknown[];
}

/** One stream's recovery answer. */
export interface RecoveryInfo {
  stream: string;
  /** A position was sent for it (not a first look at the stream). */
  wasRecovering: boolean;
  recovered: boolean;
  /** Events replayed before the answer. */
  replayed: number;
}

/** Why the application must refetch a stream's state. */
export interface ResyncInfo extends RecoveryInfo {
  reason: "recovery" | "epoch" | "gap";
  epoch: string;
  offset: number;
}

export interface Sink {
  deliver(verb: string, payload: unknown, info: EventInfo): void;
  resync(stream: string, info: ResyncInfo): void;
  recovered(info: RecoveryInfo): void;
}

export type Verdict = "first" | "next" | "old" | "gap" | "epoch";

/** How an event at (`epoch`, `offset`) follows the position `last`. */
export function judge(last: Position | undefined, epoch: string, offset: number): Verdict {
  if (last === undefined || last.epoch === "") return "first";
  if (epoch !== last.epoch) return "epoch";
  if (offset <= last.offset) return "old";
  return offset === last.offset + 1 ? "next" : "gap";
}

/** Enough for every game a page watches; the least recently moved stream goes first. */
export const MAX_STREAMS = 2000;

/** Positions by stream, written through to `storage` on every change. */
export class Positions {
  private readonly map = new Map<string, Position>();

  constructor(
    private readonly storage: StorageLike | null,
    private readonly key: string,
  ) {
    try {
      const stored = JSON.parse(storage?.getItem(key) ?? "{}") as Record<string, [string, number]>;
      for (const [stream, [epoch, offset]] of Object.entries(stored)) {
        if (typeof epoch === "string" && Number.isInteger(offset))
          this.map.set(stream, { epoch, offset });
      }
    } catch {
      // Unreadable or corrupt: start afresh (every stream is then learned anew).
    }
  }

  get(stream: string): Position | undefined {
    return this.map.get(stream);
  }

  set(stream: string, epoch: string, offset: number): void {
    this.map.delete(stream);
    this.map.set(stream, { epoch, offset });
    if (this.map.size > MAX_STREAMS) this.map.delete(this.map.keys().next().value as string);
    const stored: Record<string, [string, number]> = {};
    for (const [name, p] of this.map) stored[name] = [p.epoch, p.offset];
    try {
      this.storage?.setItem(this.key, JSON.stringify(stored));
    } catch {
      // A full or forbidden storage keeps the positions for this page's life only.
    }
  }
}

interface Recovery {
  was: boolean;
  replayed: number;
  /** Replayed frames of a coalesced verb held for one call (with any skips among them). */
  held: StreamFrame[];
}

/**
 * Follows every stream of one client. Positions advance only after the handler returns.
 * `begin` names the streams a subscribe or watchGames is about to recover; their frames
 * count as replayed until their `recovered` answer.
 */
export class Streams {
  private recovering = new Map<string, Recovery>();

  constructor(
    readonly positions: Positions,
    private readonly coalesce: ReadonlySet<string>,
    private readonly sink: Sink,
  ) {}

  /** The `since` to send for `streams`, which count as recovering from now on. */
  begin(streams: string[]): Record<string, Position> {
    const since: Record<string, Position> = {};
    for (const stream of streams) {
      const known = this.positions.get(stream);
      since[stream] = known ?? { epoch: "", offset: 0 };
      this.recovering.set(stream, { was: !!known?.epoch, replayed: 0, held: [] });
    }
    return since;
  }

  /** The streams of an action the server refused: no answer is coming for them. */
  drop(streams: string[]): void {
    for (const stream of streams) this.flushAndForget(stream);
  }

  /** The socket is gone: deliver what is held, forget what was being recovered. */
  reset(): void {
    for (const stream of [...this.recovering.keys()]) this.flushAndForget(stream);
  }

  frame(frame: StreamFrame): void {
    const { stream, epoch, offset, verb } = frame;
    const recovery = this.recovering.get(stream);
    const held = recovery?.held ?? [];
    const last = held.length ? held[held.length - 1] : this.positions.get(stream);
    const verdict = judge(last, epoch, offset);
    if (verdict === "old") return;
    const skip = verb === "skip";
    if (recovery && !skip) recovery.replayed++;
    if (verdict === "gap" || verdict === "epoch") {
      this.flush(stream, recovery);
      this.sink.resync(stream, {
        stream,
        reason: verdict,
        wasRecovering: false,
        recovered: false,
        replayed: 0,
        epoch,
        offset,
      });
    }
    if (recovery && (skip ? held.length > 0 : this.coalesce.has(verb))) {
      if (held.length && !skip && held[0]!.verb !== verb) this.flush(stream, recovery);
      recovery.held.push(frame);
      return;
    }
    this.flush(stream, recovery);
    try {
      if (!skip)
        this.sink.deliver(verb, frame.payload, {
          stream,
          epoch,
          offset,
          replayed: !!recovery,
          batch: [frame.payload],
        });
    } finally {
      this.positions.set(stream, epoch, offset);
    }
  }

  /** A `recovered` frame: the end of a replay, or a node that lost the stream's continuity. */
  answer(answer: { stream: string; recovered: boolean; epoch: string; offset: number }): void {
    const { stream, recovered, epoch, offset } = answer;
    const recovery = this.recovering.get(stream);
    this.flushAndForget(stream);
    const info: RecoveryInfo = {
      stream,
      wasRecovering: !!recovery?.was,
      recovered,
      replayed: recovery?.replayed ?? 0,
    };
    // A first look at a stream (no position sent) is not a loss; a live answer always is.
    const lost = !recovered && (!recovery || recovery.was);
    try {
      if (lost) this.sink.resync(stream, { ...info, reason: "recovery", epoch, offset });
    } finally {
      this.positions.set(stream, epoch, offset);
    }
    this.sink.recovered(info);
  }

  private flushAndForget(stream: string): void {
    this.flush(stream, this.recovering.get(stream));
    this.recovering.delete(stream);
  }

  private flush(stream: string, recovery: Recovery | undefined): void {
    if (!recovery?.held.length) return;
    const frames = recovery.held;
    recovery.held = [];
    const events = frames.filter((f) => f.verb !== "skip");
    const top = frames[frames.length - 1]!;
    try {
      if (events.length) {
        const last = events[events.length - 1]!;
        this.sink.deliver(last.verb, last.payload, {
          stream,
          epoch: last.epoch,
          offset: last.offset,
          replayed: true,
          batch: events.map((f) => f.payload),
        });
      }
    } finally {
      this.positions.set(stream, top.epoch, top.offset);
    }
  }
}
