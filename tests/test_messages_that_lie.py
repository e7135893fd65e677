"""Messages say what is true (issue 26): markup is not eaten, the audit's verdict counts what waits,
redirected output keeps a path whole, and the relay does not warn about what nobody can change."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from outbox.cli import app
from outbox.spark._report import render_report, verdict

ROOT = Path(__file__).resolve().parents[1]
counts = st.integers(min_value=0, max_value=10**6)


def test_the_spark_install_hint_keeps_its_extra(monkeypatch):
    """rich read ``[spark]`` as markup and printed ``pip install "transactional-outbox"``."""
    monkeypatch.setitem(sys.modules, "pyspark", None)  # as if the extra were not installed
    monkeypatch.delitem(sys.modules, "outbox.spark", raising=False)
    result = CliRunner().invoke(app, ["spark", "audit", "--outbox-db", "sqlite:///x.db"])
    assert result.exit_code == 2
    assert 'pip install "transactional-outbox[spark]"' in " ".join(result.stderr.split())


def summary(*, lost=0, ooo=0, keys=0, failed=0, parked=0, held=0, since="1970-01-01T00:00:00+00:00"):
    totals = {"produced": 10, "published": 10, "pending": 0, "failed": failed, "consumed": 10,
              "discarded": 0, "parked": parked, "held": held, "lost": lost, "duplicated_messages": 0,
              "extra_deliveries": 0, "out_of_order_messages": ooo, "out_of_order_keys": keys}
    end = "2026-11-25T12:00:00+00:00"
    return {"as_of": end, "window": {"since": since, "until": end},
            "sla_seconds": 900.0, "group": None, "ok": lost == 0 and ooo == 0, "totals": totals,
            "topics": {}, "groups": {}}


@given(lost=counts, ooo=counts, failed=counts, parked=counts, held=counts)
def test_the_audit_says_ok_only_when_nothing_is_lost_out_of_order_failed_parked_or_held(
        lost, ooo, failed, parked, held):
    s = summary(lost=lost, ooo=ooo, keys=min(ooo, 1), failed=failed, parked=parked, held=held)
    said = verdict(s)
    assert said.startswith("OK") == (lost == ooo == failed == parked == held == 0)
    assert said.startswith("PROBLEM") == (lost + ooo > 0)
    for count, word in ((failed, "failed outbox row"), (parked, "parked message"), (held, "held message")):
        assert (f"{count:,} {word}" in said) == (count > 0), said
    assert f"**{said}.**" in render_report(s)


def test_the_audit_without_a_window_says_all_messages_not_1970():
    everything = render_report(summary())
    assert "All messages created up to 2026-11-25T12:00:00+00:00" in everything and "1970" not in everything
    window = render_report(summary(since="2026-11-24T12:00:00+00:00"))
    assert "Messages created 2026-11-24T12:00:00+00:00 to 2026-11-25T12:00:00+00:00" in window


def test_redirected_demo_output_keeps_the_chart_path_on_one_line(tmp_path):
    """The demo's summary, printed to a pipe as ``outbox demo > log`` does: no wrap at 80 columns."""
    chart = tmp_path / ("a-long-directory-name-" * 6) / "audit" / "chart.png"
    script = textwrap.dedent(f"""
        from outbox.demo._scenario import stdout_console
        from outbox.demo._summary import Summary
        stdout_console().print(Summary(orders=10, spark_verdict="OK: nothing lost; chart {chart}").table())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, check=True).stdout
    assert any(str(chart) in line for line in out.splitlines()), out


@pytest.mark.any_kafka
def test_the_relay_does_not_warn_about_the_gapless_guarantee_it_needs(caplog):
    from transports import Record
    from transports.kafka import KafkaTransport, embedded_kafka

    caplog.set_level(logging.DEBUG, logger="transports.kafka.librdkafka")
    with embedded_kafka() as servers:
        transport = KafkaTransport({}, bootstrap_servers=servers)
        try:
            transport.publish([Record(topic="orders", value=b"{}", key=b"k")])  # logs arrive at poll
        finally:
            transport.close(1.0)
    gapless = [r for r in caplog.records if "enable.gapless.guarantee is experimental" in r.getMessage()]
    assert gapless and all(r.levelno == logging.DEBUG for r in gapless)  # still there for whoever debugs


def test_other_configuration_warnings_stay_warnings(caplog):
    from transports.kafka._logging import LibrdkafkaLog

    caplog.set_level(logging.DEBUG, logger="transports.kafka.librdkafka")
    LibrdkafkaLog().log(logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1",
                        "[thrd:app]: Configuration property queue.buffering.max.ms is deprecated")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
