"""The run's headline figures as text: one row per figure, and the printed summary.

Both the terminal summary (``loadtest.cli``) and the report's tables
(``loadtest.report.plots``) read the same rows.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from loadtest.report.targets import format_value


def print_benchmark(prog: str, argv: Sequence[str] | None, figures: dict[str, Any]) -> None:
    """A stand-alone benchmark's output: the command that ran it, then its figures as JSON."""
    given = sys.argv[1:] if argv is None else argv
    print(" ".join([prog, *given]))
    print(json.dumps(figures, indent=2))


def _fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def figure_rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(server, figure, value) rows of the headline figures of a run."""
    rows: list[tuple[str, str, str]] = []
    servers: dict[str, Any] = result["figures"]["servers"]
    for name, figs in servers.items():
        if name == "bridge":
            rows += _bridge_rows(figs)
        elif name == "cluster":
            for part in ("fanout", "presence"):
                rows += _server_rows(f"cluster ({figs['nodes']} nodes) {part}", figs[part])
        elif name == "rcluster":
            rows += _server_rows(f"Redis Cluster ({figs['nodes']} nodes) fanout", figs["fanout"])
        else:
            rows += _server_rows(name, figs)
    floor = result["figures"].get("floor")
    if floor:
        p = floor["saturate"]
        per_round = ", ".join(_fmt(r["saturate"]["delivered_per_cpu_s"]) for r in floor["rounds"])
        name = "floor (C send() loop)"
        rows.append(
            (name, "saturated: events/s (paced as ours)", f"{_fmt(p['events'] / p['window_s'])} /s")
        )
        rows.append(
            (
                name,
                "saturated: delivered per CPU-s",
                f"{_fmt(p['delivered_per_cpu_s'])} msg (rounds: {per_round})",
            )
        )
    return rows


def _server_rows(name: str, figs: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []

    def add(label: str, value: Any, unit: str = "") -> None:
        rows.append((name, label, f"{_fmt(value)} {unit}".strip()))

    if "bytes_per_stream_full_history" in figs:
        add("streams", figs["streams"])
        add("Redis bytes per stream, 1 event", figs["bytes_per_stream_one_event"], "B")
        add(
            f"Redis bytes per stream, {figs['history_size']} events (cap)",
            figs["bytes_per_stream_full_history"],
            "B",
        )
        add(
            "Redis bytes per stream, histories deleted (meta, live names)",
            figs["bytes_per_stream_meta_only"],
            "B",
        )
        add("growth past the cap, per stream", figs["growth_past_cap_bytes_per_stream"], "B")
    if "connect_rounds" in figs:
        rounds = figs["connect_rounds"]
        add("delivered per server CPU-s, right after connect", figs["delivered_per_cpu_s"])
        add("per round", ", ".join(_fmt(r["delivered_per_cpu_s"]) for r in rounds))
        if "last_seen_writes" in rounds[0]:
            add(
                "lastSeen writes / requests during the phases",
                f"{_fmt(sum(r['last_seen_writes'] for r in rounds))} / "
                f"{_fmt(sum(r['last_seen_requests'] for r in rounds))}",
            )
    if "post_to_ack" in figs:
        lat = figs["post_to_ack"]
        add("authors / nodes", f"{figs['authors']} / {figs['nodes']}")
        add(
            "comments / acks / refused / send failed / no answer",
            f"{figs['comments']} / {figs['acks']} / {sum(figs['refused'].values())}"
            f" / {figs['send_failed']} / {figs['unanswered']}",
        )
        add("refused, by code", figs["refused"] or 0)
        add("connections closed by the server", figs["closed_by_server"] or 0)
        add(
            "post -> chatAck p50/p99/max",
            f"{_fmt(lat['p50_ms'])} / {_fmt(lat['p99_ms'])} / {_fmt(lat['max_ms'])}",
            "ms",
        )
        batches = figs.get("batches")
        if batches:
            add(
                "batches; comments per batch",
                f"{_fmt(batches['batches'])}; {_fmt(batches['comments_per_batch'])}",
            )
            add(
                "per batch: lock wait / GAMECOMMENTS append / publish",
                f"{_fmt(batches['mean_lock_wait_ms'])} / {_fmt(batches['mean_store_append_ms'])}"
                f" / {_fmt(batches['mean_publish_ms'])}",
                "ms",
            )
        store = figs.get("store_get_item")
        if store:
            add(
                "DynamoDB stand-in GetItem p50/p99",
                f"{_fmt(store['p50_ms'])} / {_fmt(store['p99_ms'])}",
                "ms",
            )
        add("server CPU (both nodes)", figs.get("server_cores"), "cores")
    if "rss_per_connection_kib" in figs:
        add("RSS per connection", figs["rss_per_connection_kib"], "KiB")
    if "redis_cpu_s" in figs:
        add("Redis CPU over the scenario", figs["redis_cpu_s"], "s")
    if "redis_memory" in figs:
        memory = figs["redis_memory"]
        add(
            "Redis memory per active stream",
            f"{_fmt(memory['per_stream_bytes'])} B ({memory['streams']} streams)",
        )
    if "saturate" in figs:
        for phase in ("saturate", "steady"):
            p = figs[phase]
            tag = "saturated" if phase == "saturate" else "steady"
            add(f"{tag}: publish rate", p["publish_rate"], "/s")
            if "publishes_per_cpu_s" in p:
                add(f"{tag}: publishes per server CPU-s", p["publishes_per_cpu_s"], "/s")
            add(f"{tag}: delivered", p["delivered_per_s"], "msg/s")
            per_round = ", ".join(
                _fmt(r[phase]["delivered_per_cpu_s"]) for r in figs.get("rounds", [])
            )
            add(
                f"{tag}: delivered per server CPU-s",
                f"{_fmt(p['delivered_per_cpu_s'])} msg (rounds: {per_round})",
            )
            add(f"{tag}: server CPU while publishing", p["window_server_cores"], "cores")
            lat = p["latency"]
            rounds_p99 = ", ".join(
                _fmt(r[phase]["latency"]["p99_ms"]) for r in figs.get("rounds", [])
            )
            add(
                f"{tag}: latency p50/p99/p999",
                f"{_fmt(lat['p50_ms'])} / {_fmt(lat['p99_ms'])} / {_fmt(lat['p999_ms'])} ms"
                f" (p99 by round: {rounds_p99})",
            )
            add(f"{tag}: lost (expected - delivered)", p["lost"])
            add(
                f"{tag}: generator CPU (busiest process)",
                f"{_fmt(p['window_generator_cores'])} "
                f"({_fmt(p['window_generator_busiest_process'])})",
                "cores",
            )
    if "time_to_all_subscribed_s" in figs:
        add("time until all subscribed", figs["time_to_all_subscribed_s"], "s")
        t = figs["time_to_subscribed_s"]
        add("per-client time to snapshot p50/p99", f"{_fmt(t['p50_s'])} / {_fmt(t['p99_s'])}", "s")
        add("subscribed", f"{figs['subscribed']} / {figs['clients']}")
        add("failed connects", _failed(figs))
        queue = figs.get("tcp_listen_queue") or {}
        if queue:
            add(
                "listen queue overflows (system-wide)",
                f"{queue.get('ListenOverflows', 0)} (somaxconn {figs.get('somaxconn')})",
            )
        add("generator CPU", figs["generator_cores"], "cores")
    if "close_to_recovered_s" in figs:
        t = figs["close_to_recovered_s"]
        add("clients x nodes", f"{figs['clients']} x {figs['nodes']}")
        add(
            "events accepted / publish failures / retries",
            f"{figs['accepted_events']} / {figs['publish_failures']}"
            f" / {figs.get('publish_retries', 0)}",
        )
        add("deliveries expected (client x event)", figs["deliveries_expected"])
        add(
            "missed / duplicated / unexpected (handlers)",
            f"{figs['missed']} / {figs['duplicated']} / {figs['unexpected']}",
        )
        add("resyncs", figs["resyncs"] or "none")
        add("closes seen by clients", figs["close_codes"])
        add(
            f"close -> recovered p50/p90/p99/max ({figs['outages']} outages)",
            f"{_fmt(t['p50'])} / {_fmt(t['p90'])} / {_fmt(t['p99'])} / {_fmt(t['max'])}",
            "s",
        )
        for code, c in figs["close_to_recovered_by_first_code_s"].items():
            add(
                f"  after a {code}: p50/p99/max ({c['outages']})",
                f"{_fmt(c['p50'])} / {_fmt(c['p99'])} / {_fmt(c['max'])}",
                "s",
            )
        if figs.get("where_the_time_goes"):
            add("where the time goes", figs["where_the_time_goes"])
            add("failed attempts by reason", figs["failed_attempts_by_reason"] or "none")
        if figs.get("generator"):
            add("generator (client fleets)", figs["generator"])
        add(
            f"accepts in the busiest second per node (--accept-rate {_fmt(figs['accept_rate'])})",
            figs["accepts_busiest_second"],
        )
        add("upgrades refused (503) per node", figs["refused_upgrades"])
        add("phases", figs["phases_s"])
        add(
            "load average before / after",
            f"{figs['load_average_before']} / {figs['load_average_after']}",
        )
    if "missed" in figs and "restart" in figs:
        steady, restart = figs["steady"], figs["restart"]
        lat = steady["latency"]
        add("bots x games per bot", f"{figs['bots']} x {figs['games_per_bot']}")
        add("yourTurn rate (steady)", figs["steady_publish_rate"], "/s")
        add(
            "steady: publish -> bot p50/p99/p999",
            f"{_fmt(lat['p50_ms'])} / {_fmt(lat['p99_ms'])} / {_fmt(lat['p999_ms'])}",
            "ms",
        )
        add("steady: server CPU (both nodes)", steady["server_cores"], "cores")
        add(
            "restart: stopped / ready again / all bots resubscribed",
            f"{_fmt(restart['stop_s'])} / {_fmt(restart['back_ready_s'])} / "
            f"{_fmt(restart['all_resubscribed_s'])}",
            "s",
        )
        add("restart: bots resubscribed", f"{restart['resubscribed']} / {figs['bots']}")
        add(
            "restart: recovered true / false",
            f"{restart['recovered_true']} / {restart['recovered_false']}",
        )
        rep = restart["latency_incl_replay"]
        add(
            "during and after the restart: p50/p99/max (incl. replays)",
            f"{_fmt(rep['p50_ms'])} / {_fmt(rep['p99_ms'])} / {_fmt(rep['max_ms'])}",
            "ms",
        )
        add("turns accepted / publish failures", f"{figs['accepted']} / {figs['publish_failures']}")
        add("turns missed / duplicates", f"{figs['missed']} / {figs['duplicates']}")
        add(
            "pendingTurns frames / wrong",
            f"{figs['pending_turns_frames']} / {figs['pending_turns_wrong']}",
        )
    if "stream_checks" in figs and "saturate" in figs:
        c = figs["stream_checks"]
        add(
            "stream checks: duplicates / holes (events) / epoch changes / unpositioned",
            f"{c['duplicates']} / {c['holes']} ({c['lost']}) / {c['epoch_changes']}"
            f" / {c['unpositioned']}",
        )
    if "time_to_all_recovered_s" in figs:
        t = figs["time_to_recovered_s"]
        add("time until all recovered", figs["time_to_all_recovered_s"], "s")
        add(
            "per-client time to recovered p50/p90/p99/max",
            f"{_fmt(t['p50_s'])} / {_fmt(t['p90_s'])} / {_fmt(t['p99_s'])} / {_fmt(t['max_s'])}",
            "s",
        )
        snap = figs["time_to_snapshot_s"]
        add(
            "per-client time to snapshot p50/p99",
            f"{_fmt(snap['p50_s'])} / {_fmt(snap['p99_s'])}",
            "s",
        )
        add("clients recovered", f"{figs['recovered_clients']} / {figs['clients']}")
        add("missed events / replayed", f"{figs['missed_events']} / {figs['replayed_events']}")
        add("lost (in holes + behind the top at the end)", figs["lost"])
        add("duplicated", figs["duplicated"])
        add(
            "recovered true / false / short",
            f"{figs['recovered_true']} / {figs['recovered_false']} / {figs['recovered_short']}",
        )
        add("failed connects", _failed(figs))
        queue = figs.get("tcp_listen_queue") or {}
        if queue:
            add(
                "listen queue overflows (system-wide)",
                f"{queue.get('ListenOverflows', 0)} (somaxconn {figs.get('somaxconn')})",
            )
        add(
            "server CPU during the storm",
            f"{_fmt(figs['server_cpu_s'])} CPU-s ({_fmt(figs['server_cores'])} cores)",
        )
        add("server waiting for a CPU held by others", figs["server_cpu_wait_s"], "s")
        add("generator CPU", figs["generator_cores"], "cores")
    if "all_observers_ms" in figs:
        a, p = figs["all_observers_ms"], figs["pairs_ms"]
        add("observers subscribed", figs["subscribed"])
        add("churn actions seen / made", f"{figs['actions_seen']} / {figs['actions']}")
        add(
            "change -> all observers p50/p99/max",
            f"{_fmt(a['p50_ms'])} / {_fmt(a['p99_ms'])} / {_fmt(a['max_ms'])}",
            "ms",
        )
        for kind in ("joins", "leaves"):
            k = figs.get(f"{kind}_all_observers_ms")
            if k is not None:
                add(
                    f"{kind[:-1]} -> all observers p50/p99/max",
                    f"{_fmt(k['p50_ms'])} / {_fmt(k['p99_ms'])} / {_fmt(k['max_ms'])}",
                    "ms",
                )
        add(
            "change -> each observer p50/p99/p999",
            f"{_fmt(p['p50_ms'])} / {_fmt(p['p99_ms'])} / {_fmt(p['p999_ms'])}",
            "ms",
        )
        add("seq gaps", figs["gaps"])
        add("missed receipts", figs["missed_receipts"])
        add(
            "full observers verified / mismatched",
            f"{figs['full_observers_verified']} / {figs['state_mismatches']}",
        )
        add("server CPU", figs["server_cores"], "cores")
        add("generator CPU", figs["generator_cores"], "cores")
    return rows


def _bridge_rows(figs: dict[str, Any]) -> list[tuple[str, str, str]]:
    alone = figs["moto_alone"]
    rows: list[tuple[str, str, str]] = [
        (
            "moto alone",
            "sent / asked rate (no consumer)",
            f"{_fmt(alone['send_rate'])} / {_fmt(alone['rate_asked'])} msg/s",
        ),
        (
            "moto alone",
            "SendMessageBatch p50/p99",
            f"{_fmt(alone['send_call_ms']['p50'])} / {_fmt(alone['send_call_ms']['p99'])} ms",
        ),
    ]
    idle = figs["idle"]
    rows.append(
        (
            "bridge idle",
            "CPU cores, nothing sent (settled after)",
            ", ".join(f"{k} {_fmt(v)}" for k, v in idle["cpu_cores"].items())
            + f" ({_fmt(idle['settled_after_s'])} s)",
        )
    )
    for phase in ("steady", "backlog", "kill"):
        p = figs[phase]
        name = f"bridge {phase}"
        lat = p["latency"]
        rows += [
            (name, "sent / asked rate", f"{_fmt(p['send_rate'])} / {_fmt(p['rate_asked'])} msg/s"),
            (name, "messages sent (failed)", f"{_fmt(p['sent'])} ({_fmt(p['send_failed'])})"),
            (
                name,
                "SendMessageBatch p50/p99",
                f"{_fmt(p['send_call_ms']['p50'])} / {_fmt(p['send_call_ms']['p99'])} ms",
            ),
            (
                name,
                "queue -> socket p50/p90/p99/max",
                f"{_fmt(lat['p50_ms'])} / {_fmt(lat['p90_ms'])} / {_fmt(lat['p99_ms'])}"
                f" / {_fmt(lat['max_ms'])} ms",
            ),
            (
                name,
                "queue accepted -> socket p50/p99",
                f"{_fmt(p['accepted_to_socket']['p50_ms'])}"
                f" / {_fmt(p['accepted_to_socket']['p99_ms'])} ms",
            ),
            (
                name,
                "deliveries (watchers counted)",
                f"{_fmt(p['deliveries'])} ({p['watchers_counted']})",
            ),
            (name, "lost / duplicated", f"{p['lost']} / {p['dup']}"),
            (
                name,
                "not yet delivered (still queued)",
                f"{p['undelivered']} ({p['queue_left']} in the queue at the end)",
            ),
            (
                name,
                "CPU per message: nodes / moto",
                f"{_fmt(p['node_cpu_ms_per_message'])} / {_fmt(p['moto_cpu_ms_per_message'])} ms",
            ),
            (
                name,
                "nodes' CPU above idle, per message",
                f"{_fmt(p['node_marginal_cpu_ms_per_message'])} ms"
                f" ({_fmt(p['messages_per_node_cpu_second'])} msg per node CPU-second)",
            ),
            (
                name,
                "sender CPU per message (processes)",
                f"{_fmt(p['sender_cpu_ms_per_message'])} ms ({p['senders']})",
            ),
            (
                name,
                "queue depth mean / max (visible, in flight, delayed)",
                f"{_fmt(p['queue_depth']['mean'])} / {_fmt(p['queue_depth']['max'])}",
            ),
            (
                name,
                "CPU cores (moto, redis, nodes)",
                ", ".join(f"{k} {_fmt(v)}" for k, v in p["cpu_cores"].items()),
            ),
        ]
        if p.get("killed"):
            rows.append((name, "killed", str(p["killed"])))
    return rows


def _failed(figs: dict[str, Any]) -> str:
    causes = figs.get("failed_connects_by_cause") or {}
    detail = ", ".join(f"{k} {v}" for k, v in causes.items() if v)
    return f"{figs['failed_connects']}" + (f" ({detail})" if detail else "")


GENERATOR_LIMIT = 0.9


def _generator_limited(value: Any, path: str = "") -> list[str]:
    """Where in the figures the generator was near its CPU limit."""
    found: list[str] = []
    if isinstance(value, dict):
        for key, inner in value.items():
            if key in ("generator_share", "window_generator_share") and isinstance(
                inner, int | float
            ):
                if inner >= GENERATOR_LIMIT:
                    found.append(path.strip("/") or "run")
            elif key != "rounds":
                found += _generator_limited(inner, f"{path}/{key}")
    return found


def summary_lines(result: dict[str, Any]) -> list[str]:
    figures = result["figures"]
    lines = [f"== loadtest {result['scenario']} ({result['date']}) =="]
    rows = figure_rows(result)
    width = max((len(f"{s}  {f}") for s, f, _ in rows), default=20)
    for server, figure, value in rows:
        lines.append(f"  {f'{server}  {figure}':<{width}}  {value}")
    ratios: dict[str, float] = figures.get("ratios", {})
    if ratios:
        lines.append("ratios (ours / baseline; floor_*: ours / the C send() floor; same run):")
        for name, rel in ratios.items():
            lines.append(f"  {name:<34} {_fmt(rel)}")
    gen = result["generator"]
    lines.append(
        f"generator: {gen['generator_cpu_s']:.1f} CPU-s over {gen['wall_s']:.1f} s "
        f"({gen['generator_cores']:.2f} cores; "
        f"busiest process {gen['generator_busiest_process']:.2f})"
    )
    busy = sorted(set(_generator_limited(figures["servers"])))
    if gen.get("generator_share", 0) >= GENERATOR_LIMIT:
        busy.append("the whole run")
    if busy:
        lines.append(
            "note: the generator used >= 90% of its CPUs during: "
            + ", ".join(busy)
            + "; latency there includes the generator's own queueing"
        )
    targets = figures.get("targets", [])
    if targets:
        lines.append("targets:")
        for t in targets:
            shown = format_value(t["value"], t["unit"])
            limit = format_value(t["limit"], t["unit"])
            note = f"  ({t['note']})" if t["note"] else ""
            lines.append(
                f"  [{t['verdict'].upper():5}] {t['scenario']}: {t['figure']} "
                f"{t['op']} {limit}: {shown}{note}"
            )
    return lines
