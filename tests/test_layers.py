"""Layers run one way: ``transports`` is the lowest package and stands alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODULES = ["transports", "transports.kafka", "transports.kafka_python", "transports.memory",
           "transports.testing"]
FRAMEWORK = ("outbox", "sqlalchemy", "pydantic", "prometheus_client")


@pytest.mark.parametrize("module", MODULES)
def test_a_transport_loads_nothing_of_the_framework(module: str) -> None:
    probe = (
        f"import sys, {module}\n"
        f"loaded = sorted(m for m in {FRAMEWORK!r} if m in sys.modules)\n"
        "print(','.join(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


def test_the_framework_reexports_the_transport_errors() -> None:
    import outbox
    import transports._errors as low

    shared = ("OutboxError", "ConfigurationError", "TransportError", "RetriableTransportError",
              "InvalidTopicError")
    for name in shared:
        assert getattr(outbox, name) is getattr(low, name)


def test_console_and_ops_read_the_inbox_through_its_public_admin_api() -> None:
    """``outbox.console`` and ``outbox.ops`` import no private module of ``outbox.inbox``."""
    import ast
    import pathlib

    import outbox

    root = pathlib.Path(outbox.__file__).parent
    private = []
    for package in ("console", "ops"):
        for path in sorted((root / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    parts = node.module.split(".")
                    if "inbox" in parts and any(p.startswith("_") for p in parts[parts.index("inbox") + 1:]):
                        private.append(f"{path.relative_to(root)}: from {'.' * node.level}{node.module}")
    assert private == []


FLOORS = {
    "core": set(),
    "producer": {"core"},
    "inbox": {"core"},
    "relay": {"core", "producer"},
    "faststream": {"core", "inbox"},
    "tenants": {"core", "producer", "inbox", "relay"},
}
"""Which packages of ``outbox`` each lower package may import: the shared floor (``core``) none,
the producer and the inbox side by side on it, the relay on the producer (it is configured by an
``Outbox``), and the fleet on those. ``outbox`` itself (the public face) is above them all."""


def _outbox_packages_imported(root, path) -> set[str]:
    """The packages of ``outbox`` (or ``outbox`` itself) that one file imports, lazily or not."""
    import ast

    package = ["outbox", *path.relative_to(root).parts[:-1]]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            named = node.module.split(".") if node.module else []
            module = package[: len(package) - node.level + 1] + named if node.level else named
            targets = [module] if len(module) > 1 else [[*module, a.name] for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names]
        else:
            continue
        for target in targets:
            if target[0] == "outbox":
                found.add(target[1] if len(target) > 1 and (root / target[1]).is_dir() else "outbox")
    return found


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_the_lower_packages_import_only_the_floors_below_them(floor: str) -> None:
    """``outbox/core`` imports no package above it, producer and inbox only ``core``, and so on up."""
    import pathlib

    import outbox

    root = pathlib.Path(outbox.__file__).parent
    upward = [f"{path.relative_to(root)} imports {'outbox' if name == 'outbox' else 'outbox.' + name}"
              for path in sorted((root / floor).rglob("*.py"))
              for name in sorted(_outbox_packages_imported(root, path) - {floor} - FLOORS[floor])]
    assert upward == []


# -- the suite drives the public API where one exists (issue 25) ----------------------------------

PRIVATE_IMPORTS_IN_TESTS = 152
# 149 -> 152: the frozen-database watches' own attacks (test_frozen_attacks.py): ``OutageTracker.answered``
# patched to catch an outage ended by work begun before it, and ``GapSweeper``'s reads driven with an
# ``OutageLog`` of their own (a sweep read left unanswered during the transactions' outage): neither is
# reachable on cue through a running inbox or fleet.
# 148 -> 149: the revoke that begins between a batch's "still mine" check and its retries' return
# (test_inbox_revoke.py, ``inbox._schedule.KeyScheduler`` patched at that seam): no public call
# stops a worker there, and without it the race shows once in thousands of rebalances.
# 147 -> 148: the audit's whole-stage codegen path (test_spark_audit.py, ``spark._audit``'s
# ``SMALL_INPUT`` lowered): through the public API it takes over 100,000 outbox rows, 88 s of SQLite
# seeding alone in CI, for a path every other audit test skips.
# 144 -> 145: what the exactly-once relay's shard states keep of the producers they drop
# (test_relay_exactly_once_producer_lifetime.py, a unit of ``relay._exactly_once`` on librdkafka's mock
# cluster): through the public API a take-over failed or dropped at a chosen point takes a database
# that fails a lease confirmation on cue, with the collector off for a whole relay run.
# 145 -> 147: the lease row's unsettled topics (test_relay_exactly_once_unsettled.py, a unit of
# ``relay._unsettled`` over ``relay._leases``): that a write under an epoch no longer held changes
# nothing, and what a taker reads, is each database's SQL; through the public API it is a relay's
# lease lost at the right moment.
# 142 -> 144: how a shard's transactions are sized to the broker's pace
# (test_relay_exactly_once_pace_units.py, a unit of ``relay._exactly_once._pace`` with a ``ShardState``):
# through the public API a transaction aborted in milliseconds with its records acknowledged takes a
# broker that refuses on cue.
# 141 -> 142: what a relay's pool thread keeps of a failed job (test_relay_daemon_pool.py, a unit of
# ``relay._writer``): through the public API it is the clients of take-overs failed by a broker's kills,
# counted in /proc, freed or not by the cycle collector's timing.
# 140 -> 141: what a held shard's take-over logs when its lease was lost meanwhile
# (test_relay_exactly_once_held_units.py, a unit of ``relay._shard_producer``): through the public API
# that takes two relays and a take-over timed between a lease renewal and its confirm.
# 139 -> 140: what a settle held at its own empty record says (test_transport_kafka_held.py, a unit of
# ``transports.kafka._held``): reaching that case through the public API takes an abort marker dropped
# on a three-node cluster at the right moment.
# 138 -> 139: the closers a fleet's and a single relay's stop share (``relay._closers``) are tested as a
# unit for a race between two calls (test_tenant_relay.py), which no stop times reliably.
# 136 -> 138: the attacks on the exactly-once deadline and remake (test_relay_exactly_once_knob_attacks.py)
# patch ExactlyOnce, their subject, to time a stop between transactions, and fault the transactional
# producer's implied-delivery check, which no broker can be made to trigger on purpose.
# 135 -> 136: the exactly-once pace's attacks (test_relay_exactly_once_pace_attacks.py) force a shard's
# transaction cap on ExactlyOnce itself, so one batch spans several transactions in seconds without a
# quota; through the public API that takes a throttled broker and a minute per case.
# 132 -> 135: the relay fleet's slots per server are tested as a unit (test_tenant_slots.py): how many
# writers a hung server's writes hold is not timed reliably through a fleet on real servers.
# 129 -> 132: the exactly-once read-back's wire format and count are tested as units
# (test_transport_kafka_positions.py, test_transport_kafka_read_back_data.py: the positions header a
# transaction's last record carries; test_relay_progress_counted.py: which rows a take-over counts),
# since a broker split that exercises each case through the public API takes a three-node cluster.
# 127 -> 129: test_tenant_polls.py tests the fleet's poll jitter and backlog share (_idle_polls,
# _shares) as units: through the public API their effect is a timing only a benchmark shows.
"""Imports of a private module of ``outbox``/``transports`` by the tests (benchmarks aside).

What stays has no public equivalent, because the test's subject is that module: the wire format and
envelope (``_wire``, ``_envelope``, ``_cloudevents``: records built byte for byte as the relay
writes them, with any seq and incarnation), key hashing (``_sharding``, ``_partitioner``), the
NOTIFY payload (``_notify``), the timing wheel, outage classification and backoff (``_outage``,
``inbox._outage``), dialect helpers (``_pg_arrays``, ``_mysql``, ``_engine``, ``_statements``,
``_schema``'s version), the inbox's runner stages that the model test plays itself
(``inbox._delivery``, ``_offsets``, ``_schedule``), inbox settings and sessions, relay statements,
leases and the tenant fleet's lease renewal (its statements per round), rows and its writer thread,
the Spark session's Kafka-source jar lookup and the audit
summary's wire verdict (``spark._session``, ``spark._report``: tested apart from a Spark run),
the worker commands' stop latch, the inbox's partition checks,
the event registry (emptied for each docs page), housekeeping, Spark, console, CLI and ops internals; and
``transports._errors`` in the transports' own tests (``transports`` has no public error module, and
importing them from ``outbox`` would invert the layering there); a database's identity (``_identity``).
Lower it when one goes; raise it only for a test whose subject is a private module.
"""

INTERNAL_PHASE_CALLS_IN_TESTS = 1
"""Direct calls of ``inbox.step`` / ``inbox.settler`` / ``inbox.gaps``: one, the inbox model test's
``sweep`` rule, which plays the runner's own sweep (held deliveries join their lanes' queues);
everything else settles through ``OutboxTestHarness.settle``."""


def _test_sources() -> list[tuple[str, str]]:
    import pathlib

    here = pathlib.Path(__file__).parent
    return [(str(path.relative_to(here)), path.read_text()) for path in sorted(here.rglob("*.py"))
            if "benchmarks" not in path.relative_to(here).parts]


def _private_imports(source: str) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            parts = name.split(".")
            if parts[0] in ("outbox", "transports") and any(p.startswith("_") for p in parts[1:]):
                found.append(name)
    return found


def test_no_test_writes_the_inbox_handler_registry() -> None:
    """A test swaps a handler with ``inbox.handler(topic, replace=True)``, not ``inbox._handlers``."""
    import re

    writes = [f"{name}:{n}" for name, text in _test_sources()
              for n, line in enumerate(text.splitlines(), 1)
              if re.search(r"\._handlers\b", line) and name != "test_layers.py"]
    assert writes == []


def test_tests_drive_the_inbox_phases_through_the_public_driver() -> None:
    import re

    calls = [f"{name}:{n}" for name, text in _test_sources()
             for n, line in enumerate(text.splitlines(), 1)
             if re.search(r"\.(step|settler|gaps)\.", line) and name != "test_layers.py"]
    assert len(calls) <= INTERNAL_PHASE_CALLS_IN_TESTS, calls


def test_private_imports_in_tests_do_not_grow_back() -> None:
    found = [f"{name}: {module}" for name, text in _test_sources() for module in _private_imports(text)]
    assert len(found) <= PRIVATE_IMPORTS_IN_TESTS, (
        f"{len(found)} private imports in tests (at most {PRIVATE_IMPORTS_IN_TESTS}); import what is "
        "public from its package (outbox, outbox.inbox, outbox.relay, outbox.testing, transports)")


def test_every_retry_a_transport_or_the_relay_makes_says_whether_the_broker_was_unreachable() -> None:
    """``SendResult(Outcome.RETRY, …)`` without ``unreachable`` counts an attempt by default, and two
    records never sent came back that way (``NOT_SENT_ALONE``; ``UNPROVEN``): each maker of a retry
    now decides, in writing, whether it was the record's doing (counted) or the broker's (an outage:
    no attempt). Results classified from a broker error (``result_of``) decide by the error."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    silent = []
    for package in ("transports", "outbox"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if called != "SendResult":
                    continue
                outcome = node.args[0] if node.args else next(
                    (k.value for k in node.keywords if k.arg == "outcome"), None)
                decided = any(k.arg == "unreachable" for k in node.keywords)
                if outcome is not None and ast.unparse(outcome) == "Outcome.RETRY" and not decided:
                    silent.append(f"{path.relative_to(root)}:{node.lineno}")
    assert silent == []
