"""``chart.png``: latency percentiles and backlog over time, readable without the JSON.

Top: relay lag and end-to-end latency p50/p95/p99 per topic (and group).
Bottom: over time, messages created but not yet published, and per group
messages published but not yet processed, so a growing backlog stands out.

matplotlib is imported when a chart is drawn, not with the package: Spark's
Python workers import ``outbox.spark`` to read tables and must not pay for it.
It draws on a ``Figure`` of its own (Agg canvas), not through pyplot's global state.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from pathlib import Path
from threading import Thread
from typing import Any

from ._report import waiting


def preload_matplotlib() -> None:
    """Import matplotlib on a daemon thread, so the chart does not wait for it later."""
    def load() -> None:
        import matplotlib.backends.backend_agg
        import matplotlib.figure  # noqa: F401

    Thread(target=load, name="matplotlib-import", daemon=True).start()


def draw_chart(path: Path, summary: dict[str, Any], produced: list[dict[str, Any]],
               processed: list[dict[str, Any]], start: datetime, bucket_seconds: float) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 8.5), layout="constrained")
    top, bottom = figure.subplots(2, 1)
    _latency(top, summary)
    _backlog(bottom, summary, produced, processed, start, bucket_seconds)
    totals = summary["totals"]
    verdict = (f"{totals['lost']:,} LOST, {totals['out_of_order_messages']:,} OUT OF ORDER"
               if not summary["ok"] else "NEEDS ATTENTION" if waiting(totals) else "OK")
    figure.suptitle(f"Outbox audit as of {summary['as_of'][:19]} UTC: {verdict}", fontsize=13)
    figure.savefig(path, dpi=110)


def _latency(ax: Any, summary: dict[str, Any]) -> None:
    labels, series = [], defaultdict(list)
    for topic, row in summary["topics"].items():
        labels.append(f"relay\n{topic}")
        for q, v in row["relay_lag_ms"].items():
            series[q].append(v or 0)
    for group, topics in summary["groups"].items():
        for topic, row in topics.items():
            labels.append(f"end-to-end\n{group}/{topic}")
            for q, v in row["latency_ms"].items():
                series[q].append(v or 0)
    width = 0.8 / max(1, len(series))
    for index, (q, values) in enumerate(series.items()):
        ax.bar([x + index * width for x in range(len(labels))], values, width, label=q)
    ax.set_xticks([x + width for x in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("milliseconds")
    ax.set_title("Latency percentiles (relay: created → published; end-to-end: created → processed)")
    if any(v > 0 for values in series.values() for v in values):
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    if ax.get_legend_handles_labels()[0]:  # an empty window has nothing to label
        ax.legend()
    ax.grid(axis="y", alpha=0.3)


def _backlog(ax: Any, summary: dict[str, Any], produced: list[dict[str, Any]],
             processed: list[dict[str, Any]], start: datetime, bucket_seconds: float) -> None:
    buckets = sorted({r["bucket"] for r in produced} | {r["bucket"] for r in processed})
    if not buckets:
        ax.text(0.5, 0.5, "no messages in the window", ha="center", transform=ax.transAxes)
        return
    times = [start + timedelta(seconds=(b + 1) * bucket_seconds) for b in buckets]
    created: dict[int, int] = defaultdict(int)
    published: dict[int, int] = defaultdict(int)
    published_by_topic: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in produced:
        created[r["bucket"]] += r["created"]
        published[r["bucket"]] += r["published"]
        published_by_topic[r["topic"]][r["bucket"]] += r["published"]
    ax.plot(times, _running(buckets, created, published), label="not yet published", linewidth=2)
    done: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in processed:
        done[r["consumer_group"]][r["bucket"]] += r["processed"]
    for group, topics in summary["groups"].items():
        arrived: dict[int, int] = defaultdict(int)
        for topic in topics:
            for b, n in published_by_topic[topic].items():
                arrived[b] += n
        ax.plot(times, _running(buckets, arrived, done[group]), label=f"not yet processed by {group}")
    ax.set_ylabel("messages")
    ax.set_title(f"Backlog over time (UTC, {bucket_seconds:,.0f} s buckets)")
    ax.legend()
    ax.grid(alpha=0.3)


def _running(buckets: list[int], added: dict[int, int], removed: dict[int, int]) -> list[int]:
    total, out = 0, []
    for b in buckets:
        total += added.get(b, 0) - removed.get(b, 0)
        out.append(total)
    return out
