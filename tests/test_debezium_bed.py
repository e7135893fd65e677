"""``outbox.testing``'s Debezium: the Kafka Connect worker is ours, on its port, for our broker;
its faults do what they say; what is missing is said in one line, and fails in CI."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import unavailable

from outbox.testing import (
    DEBEZIUM_LIBS_VARIABLE,
    ConnectStartError,
    DebeziumOutbox,
    LocalKafkaConnect,
    create_topic,
    free_port,
    wait_until_bound,
)
from transports.testing import read_topic

ROOT = Path(__file__).resolve().parents[1]


def held_by(port: int) -> socket.socket:
    """A listening socket on ``port``: what another xdist worker's server would be."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def local_connect(kafka: str, **kwargs) -> LocalKafkaConnect:  # type: ignore[no-untyped-def]
    try:
        return LocalKafkaConnect(kafka, **kwargs)
    except FileNotFoundError as exc:
        unavailable(str(exc))
        raise


@pytest.mark.kafka
@pytest.mark.debezium
@pytest.mark.slow
def test_the_worker_holds_its_port_answers_for_our_broker_and_survives_stop_and_start(
        kafka: str, debezium_db: str) -> None:
    """A connector created before a clean stop runs again after ``start()`` and resumes where its
    flushed offsets say: an event committed while the worker was down arrives once."""
    with local_connect(kafka) as connect, DebeziumOutbox(connect, debezium_db, kafka) as debezium:
        assert connect.pid is not None
        wait_until_bound(connect.pid, connect.port, "Kafka Connect", timeout=5)
        info = connect.info()
        assert info["kafka_cluster_id"] == connect.cluster_id and info["version"] == "4.3.0"
        topic = debezium.topic(f"bed{uuid.uuid4().hex[:8]}")
        kind = topic.removeprefix("outbox.event.")
        create_topic(kafka, topic, 1)
        with debezium.engine.begin() as conn:
            first = debezium.insert(conn, kind, "k", {"n": 1})
        assert len(read_topic(kafka, topic, expected=1, timeout=60)) == 1
        connect.stop()  # SIGTERM: offsets flushed
        assert connect.pid is None
        with debezium.engine.begin() as conn:
            second = debezium.insert(conn, kind, "k", {"n": 2})
        connect.start()
        records = read_topic(kafka, topic, expected=2, timeout=120, settle=3)
        assert [dict(r.headers)["id"] for r in records] == [str(first).encode(), str(second).encode()]
        status = connect.status(debezium.name)
        assert status is not None and status["tasks"][0]["state"] == "RUNNING"


@pytest.mark.kafka
@pytest.mark.debezium
@pytest.mark.slow
def test_a_first_start_that_finds_its_port_taken_starts_again_on_a_new_one(
        kafka: str, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = free_port()
    picks = iter([taken])
    monkeypatch.setattr("outbox.testing._connect.free_port", lambda: next(picks, None) or free_port())
    taker = held_by(taken)
    try:
        with local_connect(kafka) as connect:
            assert connect.port != taken
            assert connect.info()["kafka_cluster_id"] == connect.cluster_id
            assert "Address already in use" in connect.log_path.read_text()  # the first start lost it
    finally:
        taker.close()


@pytest.mark.kafka
@pytest.mark.debezium
@pytest.mark.slow
def test_a_worker_that_answers_for_another_cluster_is_refused(kafka: str) -> None:
    with pytest.raises(ConnectStartError, match="answers for Kafka cluster"):
        local_connect(kafka, cluster_id="not-our-cluster", start_timeout=120)


def test_a_local_worker_refuses_to_start_without_its_jars_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBEZIUM_LIBS_VARIABLE, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="scripts/setup") as refused:
        LocalKafkaConnect("127.0.0.1:9", cluster_id="x")
    assert "\n" not in str(refused.value)


def test_debezium_on_a_server_without_logical_decoding_is_refused_naming_it(postgres_db: str) -> None:
    """The suite's usual PostgreSQL runs with ``wal_level=replica``: Debezium cannot read it."""
    with sa.create_engine(postgres_db).connect() as conn:
        if conn.exec_driver_sql("SHOW wal_level").scalar() == "logical":
            pytest.skip("this PostgreSQL has logical decoding on")
    with pytest.raises(ValueError, match="wal_level=logical"):
        DebeziumOutbox(object(), postgres_db, "127.0.0.1:9")  # type: ignore[arg-type]


DEBEZIUM_TEST = ("tests/test_debezium.py::"
                 "test_a_failing_event_parks_its_key_and_a_replay_applies_the_rest_in_order")


@pytest.mark.slow  # a pytest of its own, which starts Apache Kafka: 20-60 s
@pytest.mark.kafka
@pytest.mark.parametrize(("ci", "outcome"), [("", "1 skipped"), ("true", "1 error")], ids=["locally", "CI"])
def test_without_debezium_its_tests_skip_locally_and_fail_in_ci(tmp_path: Path, ci: str,
                                                                outcome: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"OUTBOX_TEST_KAFKA_CONNECT_URL", "CI"}}
    env.update({DEBEZIUM_LIBS_VARIABLE: str(tmp_path), "CI": ci})
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rsf", "-p", "no:xdist",
                          DEBEZIUM_TEST], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert outcome in run.stdout, run.stdout[-3000:]
    assert "no Kafka Connect" in run.stdout and "scripts/setup" in run.stdout, run.stdout[-3000:]


def test_a_bundle_that_cannot_be_fetched_is_said_in_one_line(tmp_path: Path) -> None:
    """No Maven: ``scripts/jvm/fetch debezium`` says so in one line and exits 1 (``scripts/setup``
    ends there with ``CI=true``)."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts" / "jvm").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "jvm" / "fetch", checkout / "scripts" / "jvm" / "fetch")
    shutil.copytree(ROOT / "scripts" / "jvm" / "debezium", checkout / "scripts" / "jvm" / "debezium")
    bin_dir = tmp_path / "bin"  # the tools the script uses, and no mvn
    bin_dir.mkdir()
    for tool in ("bash", "sha256sum", "cut", "cat", "dirname", "mkdir", "rm", "grep"):
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    run = subprocess.run([str(bin_dir / "bash"), str(checkout / "scripts" / "jvm" / "fetch"), "debezium"],
                         env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and "could not fetch the debezium jars" in run.stderr, run.stderr
    assert "Maven (mvn) is not installed" in run.stderr
    setup = (ROOT / "scripts" / "setup").read_text()
    assert "if ! scripts/jvm/fetch debezium; then\n  in_ci && exit 1" in setup
