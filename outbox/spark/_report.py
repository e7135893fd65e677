"""The audit's findings as ``summary.json`` and a short ``report.md`` a person reads first."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from ._findings import QUANTILES
from ._window import Window

Pair = tuple[str, str]
GROUP_FIELDS = ("consumed", "discarded", "parked", "held", "lost", "duplicated_messages",
                "extra_deliveries", "out_of_order_messages", "out_of_order_keys")
TOPIC_FIELDS = ("produced", "published", "pending", "failed")
# What the wire audit counts per topic, and the finding (Parquet dataset) each count comes from.
WIRE_FIELDS = {"missing": "wire_missing", "duplicated_messages": "wire_duplicates",
               "extra_copies": "wire_extra_copies", "out_of_order_messages": "wire_out_of_order",
               "foreign": "wire_foreign"}


def _quantiles(values: list[float] | None) -> dict[str, float | None]:
    found: list[float | None] = list(values) if values else [None] * len(QUANTILES)
    return {f"p{round(q * 100)}": v for q, v in zip(QUANTILES, found, strict=True)}


def build_summary(
    *, as_of: datetime, window: Window, sla: timedelta, group: str | None,
    event_type: str | None = None, topics: list[dict[str, Any]], groups: list[dict[str, Any]],
    found: dict[str, dict[Pair, int]], bad_keys: dict[Pair, int],
    wire: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON summary: per topic, per group and topic, totals, and the verdict.

    ``groups`` has one row per (group, topic) the consumer side knows
    (``_findings.group_counts``); ``found`` counts each finding per pair.
    ``wire`` is ``wire_summary``'s, when the audit read the topics: its totals
    join the others as ``wire_*`` and its verdict joins ``ok``.
    """
    by_topic: dict[str, dict[str, Any]] = {
        t["topic"]: {**{f: int(t[f] or 0) for f in TOPIC_FIELDS},
                     "relay_lag_ms": _quantiles(t["relay_lag_ms"])}
        for t in sorted(topics, key=lambda t: t["topic"])
    }
    consumed = {(g["consumer_group"], g["topic"]): g for g in groups}
    by_group: dict[str, dict[str, Any]] = {}
    for pair in sorted(consumed):
        g = consumed[pair]
        by_group.setdefault(pair[0], {})[pair[1]] = {
            "consumed": int(g.get("consumed") or 0),
            "discarded": int(g.get("discarded") or 0),
            "parked": int(g.get("parked") or 0),
            "held": int(g.get("held") or 0),
            "lost": found["lost"].get(pair, 0),
            "duplicated_messages": found["duplicates"].get(pair, 0),
            "extra_deliveries": int(g.get("extra_deliveries") or 0),
            "out_of_order_messages": found["out_of_order"].get(pair, 0),
            "out_of_order_keys": bad_keys.get(pair, 0),
            "latency_ms": _quantiles(g.get("latency_ms")),
        }
    totals: dict[str, int] = {f: sum(t[f] for t in by_topic.values()) for f in TOPIC_FIELDS}
    for f in GROUP_FIELDS:
        totals[f] = sum(int(row[f]) for topics_of in by_group.values() for row in topics_of.values())
    ok = totals["lost"] == 0 and totals["out_of_order_messages"] == 0
    summary: dict[str, Any] = {
        "as_of": as_of.isoformat(),
        "window": {"since": window.since.isoformat(), "until": window.until.isoformat()},
        "sla_seconds": sla.total_seconds(),
        "group": group,
        "event_type": event_type,
        "ok": ok,
        "totals": totals,
        "topics": by_topic,
        "groups": by_group,
    }
    if wire is not None:
        totals.update({f"wire_{name}": count for name, count in wire["totals"].items()})
        summary["ok"] = ok and wire["ok"]
        summary["wire"] = wire
    return summary


def wire_summary(topics: list[str], records: dict[str, int], found: dict[str, dict[str, int]],
                 bad_keys: dict[str, int], *, exactly_once: bool) -> dict[str, Any]:
    """The wire audit's part of the summary: per topic read, its counts; totals; its verdict.

    Missing and out-of-order messages fail it; duplicates only with ``exactly_once``
    (at-least-once delivery allows them); foreign records never (not this outbox's doing).
    """
    by_topic = {topic: {"records": records.get(topic, 0),
                        **{name: found.get(finding, {}).get(topic, 0)
                           for name, finding in WIRE_FIELDS.items()},
                        "out_of_order_keys": bad_keys.get(topic, 0)}
                for topic in sorted(topics)}
    fields = ["records", *WIRE_FIELDS, "out_of_order_keys"]
    totals = {f: sum(row[f] for row in by_topic.values()) for f in fields}
    ok = totals["missing"] == 0 and totals["out_of_order_messages"] == 0 \
        and not (exactly_once and totals["duplicated_messages"])
    return {"exactly_once": exactly_once, "ok": ok, "totals": totals, "topics": by_topic}


def write_report(out: Path, summary: dict[str, Any]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    (out / "report.md").write_text(render_report(summary))


def _ms(q: dict[str, float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:,.0f}" for v in q.values())


EPOCH = "1970-01-01T00:00:00+00:00"  # the start of a window that was not given: every message


def waiting(totals: dict[str, Any]) -> list[str]:
    """What is neither lost nor done and needs a person: failed rows, parked and held messages."""
    found = [(totals.get("failed", 0), "failed outbox row(s) blocking their keys (outbox failed list)"),
             (totals.get("parked", 0), "parked message(s) (outbox parked list)"),
             (totals.get("held", 0), "held message(s) waiting for an earlier seq")]
    return [f"{count:,} {what}" for count, what in found if count]


def verdict(s: dict[str, Any]) -> str:
    """The report's first sentence: OK only when nothing is lost, out of order, failed, parked or held.

    ``ok`` (the exit status) stays about loss and order; a failed row or a parked
    message is not lost, but an "OK" beside it would tell the reader to look no further.
    """
    t = s["totals"]
    attention = waiting(t)
    if not s["ok"]:
        head = (f"PROBLEM: {t['lost']:,} lost, {t['out_of_order_messages']:,} out of order "
                f"(in {t['out_of_order_keys']:,} keys)")
        if "wire" in s:
            head += (f"; on the wire {t['wire_missing']:,} missing, "
                     f"{t['wire_out_of_order_messages']:,} out of order, "
                     f"{t['wire_duplicated_messages']:,} duplicated")
    elif attention:
        head = "NEEDS ATTENTION: nothing lost, nothing out of order, but"
        return f"{head} {', '.join(attention)}"
    else:
        return "OK: nothing lost, nothing out of order, nothing failed, parked or held"
    return f"{head}; also {', '.join(attention)}" if attention else head


def window_line(s: dict[str, Any]) -> str:
    """Which messages the audit read: a window's bounds, or all of them up to its end."""
    window = s["window"]
    if window["since"] == EPOCH:
        return f"All messages created up to {window['until']}, as of {s['as_of']}"
    return f"Messages created {window['since']} to {window['until']}, as of {s['as_of']}"


def render_report(s: dict[str, Any]) -> str:
    lines = [
        "# Outbox audit",
        "",
        f"**{verdict(s)}.**",
        "",
        f"{window_line(s)}; "
        f"a published message counts as lost after {s['sla_seconds']:g} s without reaching a group"
        + (f"; only messages of event type {s['event_type']}." if s.get("event_type") else "."),
        "",
        "## Producer side, per topic",
        "",
        "| topic | produced | published | pending | failed | relay lag ms p50 / p95 / p99 |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in s["topics"].items():
        lines.append(f"| {name} | {row['produced']:,} | {row['published']:,} | {row['pending']:,} "
                     f"| {row['failed']:,} | {_ms(row['relay_lag_ms'])} |")
    lines += [
        "",
        "## Consumer side, per group and topic",
        "",
        "| group | topic | consumed | lost | parked | held | duplicated | out of order (keys) "
        "| latency ms p50 / p95 / p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for group, topics in s["groups"].items():
        for name, row in topics.items():
            lines.append(
                f"| {group} | {name} | {row['consumed']:,} | {row['lost']:,} | {row['parked']:,} "
                f"| {row['held']:,} | {row['duplicated_messages']:,} "
                f"| {row['out_of_order_messages']:,} ({row['out_of_order_keys']:,}) "
                f"| {_ms(row['latency_ms'])} |")
    lines += [
        "",
        "Every lost, duplicated and out-of-order message is listed in the Parquet datasets "
        "`lost/`, `duplicates/` and `out_of_order/`; `chart.png` shows latency and backlog "
        "over time. Parked and held messages are waiting in the inbox (`outbox parked list`), "
        "not lost.",
        "",
    ]
    if "wire" in s:
        lines += render_wire(s["wire"])
    return "\n".join(lines)


def render_wire(w: dict[str, Any]) -> list[str]:
    """The report's section on what the topics hold (read_committed)."""
    duplicates = ("a duplicate fails the audit (exactly-once)" if w["exactly_once"]
                  else "duplicates are counted, not failed (at-least-once allows them)")
    lines = [
        "## On the wire, per topic (read_committed)",
        "",
        f"Published rows missing from the topic and reordered messages fail the audit; {duplicates}.",
        "",
        "| topic | records read | missing | duplicated (extra copies) | out of order (keys) | foreign |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in w["topics"].items():
        lines.append(f"| {name} | {row['records']:,} | {row['missing']:,} "
                     f"| {row['duplicated_messages']:,} ({row['extra_copies']:,}) "
                     f"| {row['out_of_order_messages']:,} ({row['out_of_order_keys']:,}) "
                     f"| {row['foreign']:,} |")
    lines += [
        "",
        "Each is listed in `wire_missing/`, `wire_duplicates/`, `wire_out_of_order/` and "
        "`wire_foreign/` (with the reason: no envelope, broken envelope, another outbox's, "
        "an id this outbox does not hold).",
        "",
    ]
    return lines
