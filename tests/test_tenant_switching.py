"""``outbox relay --tenants`` hands the interpreter lock to a waiting thread within a millisecond,
and its producers linger until the flush.

A quiet tenant's message passes through many threads of the fleet's process,
each waiting for the lock a backlog's worker holds: CPython's default switch
interval (5 ms) was paid at each step (docs/tenants.md, *The interpreter
lock*). With the lock switching every millisecond a worker's produce loop is
cut into slices, and at librdkafka's 5 ms linger its batch left in several
small requests (``FLEET_LINGER_MS``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from outbox.cli import _relay as relay_cli
from outbox.cli import app
from outbox.tenants import FLEET_LINGER_MS, TenantRelay, fleet_kafka_settings


def test_tune_switch_interval_sets_a_millisecond() -> None:
    """In a fresh interpreter: it changes a process-wide setting, never this test run's."""
    code = ("import sys, outbox.tenants as t; before = sys.getswitchinterval(); t.tune_switch_interval(); "
            "print(before, sys.getswitchinterval())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = map(float, out.stdout.split())
    assert before == 0.005 and abs(after - 0.001) < 1e-9


def _fleet_command(tmp_path, monkeypatch, instead_of_run, *args: str) -> None:
    """Run ``outbox relay --tenants`` (two tenants, ``args``) up to its fleet's ``run``, which calls
    ``instead_of_run(fleet)``; this test run's switch interval and heap are left as they were."""
    monkeypatch.setattr(TenantRelay, "run", lambda self, **_: instead_of_run(self))
    monkeypatch.setattr(relay_cli, "tune_gc_for_batches", lambda: None)  # not this test run's heap
    spec = tmp_path / "tenants.json"
    spec.write_text(json.dumps(["acme", "globex"]))
    before = sys.getswitchinterval()
    try:
        result = CliRunner().invoke(app, [
            "relay", "--db", f"sqlite:///{tmp_path / 'fleet.db'}", "--bootstrap-servers", "127.0.0.1:9",
            "--tenants", f"file:{spec}", *args])
    finally:
        sys.setswitchinterval(before)
    assert result.exit_code == 0, result.output


def test_the_fleet_command_runs_its_tenants_with_the_short_switch_interval(tmp_path, monkeypatch) -> None:
    seen: list[float] = []
    _fleet_command(tmp_path, monkeypatch, lambda _fleet: seen.append(sys.getswitchinterval()))
    assert len(seen) == 1 and abs(seen[0] - 0.001) < 1e-9  # 1 ms (docs/tenants.md, *The interpreter lock*)


@pytest.mark.parametrize("named", [
    {"linger.ms": "7"}, {"linger_ms": 7}, {"queue.buffering.max.ms": "7"},
    {"message.timeout.ms": "90"}, {"delivery_timeout_ms": 90}, {"delivery.timeout.ms": "90"},
    {"topic.message.timeout.ms": "90"}, {"default.topic.config": {"message.timeout.ms": "90"}}])
def test_a_linger_or_message_timeout_the_settings_name_under_any_name_is_theirs(
        named: dict[str, object]) -> None:
    """The property is what counts, not its spelling: a kafka-python-ng keyword or librdkafka's
    alias set the same one, and a default added beside it would override it (the later wins).
    A message timeout set is kept with the transport's linger: librdkafka refuses one no longer
    than the linger (90 ms against 100 would fail the fleet at start over a linger nobody set)."""
    settings = {"bootstrap.servers": "h:9", **named}
    assert fleet_kafka_settings(settings) == settings


def test_settings_without_a_linger_get_the_fleets_and_unkeyed_records_keep_their_spread() -> None:
    given = {"bootstrap.servers": "h:9", "acks": "all"}
    assert fleet_kafka_settings(given) == {
        **given, "linger.ms": FLEET_LINGER_MS, "sticky.partitioning.linger.ms": 10}  # as at a 5 ms linger
    assert "linger.ms" not in given  # a copy: the caller's mapping is not changed
    sticky = {"sticky.partitioning.linger.ms": "50"}
    assert fleet_kafka_settings(sticky) == {**sticky, "linger.ms": FLEET_LINGER_MS}


def _fleet_producers(tmp_path, monkeypatch, *args: str) -> list[dict[str, object]]:
    """The librdkafka settings of each producer ``outbox relay --tenants`` built, with ``args``."""
    seen: list[dict[str, object]] = []
    _fleet_command(tmp_path, monkeypatch, lambda fleet: seen.extend(
        dict(made._config) for made in fleet._workers.transports), *args)
    return seen


def test_the_fleet_commands_producers_linger_until_the_flush_unless_told(tmp_path, monkeypatch) -> None:
    lingers = [made["linger.ms"] for made in _fleet_producers(tmp_path, monkeypatch)]
    assert lingers == [FLEET_LINGER_MS, FLEET_LINGER_MS]
    told = _fleet_producers(tmp_path, monkeypatch, "-X", "linger_ms=7")
    assert [made["linger.ms"] for made in told] == ["7", "7"]


def test_a_record_limit_set_by_its_kafka_python_name_is_not_raised_for_the_tenant_header(
        tmp_path, monkeypatch) -> None:
    """``max_request_size`` is ``message.max.bytes``: the header's room is added only to a limit
    nobody set, never to the user's, whatever name they gave it."""
    header = ["--tenant-header", "x-tenant"]
    default, = {made["message.max.bytes"] for made in _fleet_producers(tmp_path, monkeypatch, *header)}
    assert int(default) > 1_000_000  # the default limit with room for the header
    told = _fleet_producers(tmp_path, monkeypatch, *header, "-X", "max_request_size=500000")
    assert {made["message.max.bytes"] for made in told} == {"500000"}


def test_the_fleet_command_caps_its_shard_producers_as_asked(tmp_path, monkeypatch) -> None:
    """``--max-shard-producers`` reaches the fleet (its default is the library's)."""
    given: list[object] = []
    made = TenantRelay.__init__

    def init(self, *args, **kwargs) -> None:
        given.append(kwargs.get("max_shard_producers"))
        made(self, *args, **kwargs)

    monkeypatch.setattr(TenantRelay, "__init__", init)
    _fleet_command(tmp_path, monkeypatch, lambda _fleet: None, "--exactly-once", "--max-shard-producers", "7")
    _fleet_command(tmp_path, monkeypatch, lambda _fleet: None, "--exactly-once")
    assert given == [7, None]


@pytest.mark.parametrize("args, says", [
    (["--max-shard-producers", "7"], "needs --tenants and --exactly-once"),
    (["--max-shard-producers", "7", "--exactly-once"], "needs --tenants and --exactly-once"),
    (["--max-shard-producers", "0", "--exactly-once"], "Invalid value for '--max-shard-producers'"),
    (["--max-shard-producers", "901", "--exactly-once"], "Invalid value for '--max-shard-producers'"),
])
def test_a_shard_producer_cap_the_command_cannot_use_is_refused_in_one_line(tmp_path, args, says) -> None:
    """Without a fleet in exactly-once mode nothing is capped: refused, not ignored; out of range, the
    option is named. Before anything connects (the broker here answers nothing)."""
    result = CliRunner().invoke(app, ["relay", "--db", f"sqlite:///{tmp_path / 'r.db'}",
                                      "--bootstrap-servers", "127.0.0.1:9", *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "--max-shard-producers" in result.output, result.output
