"""``/healthz`` and ``/readyz`` on a worker's metrics port, and every option read from the environment.

The relay is configured only through ``OUTBOX_…`` variables here, as a
container would configure it. ``/readyz`` must turn 503 while its PostgreSQL
is stopped and 200 again after, while ``/healthz`` stays 200 all along (an
outage is waited out, never a reason to restart a worker); a standby relay
(its fair share is 0 shards) is ready; a consumer is ready once it holds a
partition.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import typer
from _relay_helpers import wait_for
from typer.core import TyperGroup, TyperOption

from outbox import Outbox, create_engine
from outbox.cli import app
from outbox.cli._options import COMMAND_LINE_ONLY
from outbox.testing import LocalPostgres, free_port, wait_until_bound
from tests.inbox_support import INBOX_KINDS, async_url

pytestmark = pytest.mark.postgres


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError:
        return 0, ""  # not listening yet


def start(args: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "outbox", *args], env={**os.environ, **env},
                            stdout=log.open("a"), stderr=subprocess.STDOUT, cwd=cwd)


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_relay_readyz_follows_its_database_and_leases_while_healthz_stays_up(
    own_postgres: LocalPostgres, any_kafka: str, tmp_path: Path
) -> None:
    outbox = Outbox(create_engine(own_postgres.url), shards=1)
    outbox.create_tables()
    outbox.engine.dispose()  # type: ignore[union-attr]
    env = {"OUTBOX_DB": own_postgres.url, "OUTBOX_BOOTSTRAP_SERVERS": any_kafka,
           "OUTBOX_RELAY_LEASE_TTL": "2", "OUTBOX_LOG_LEVEL": "WARNING"}
    port, standby_port = free_port(), free_port()
    relay = start(["relay"], {**env, "OUTBOX_METRICS_PORT": str(port), "OUTBOX_RELAY_WORKER_ID": "a"},
                  tmp_path / "a.log")
    standby = None
    try:
        wait_until_bound(relay.pid, port, "the relay's health server", alive=lambda: relay.poll() is None)
        wait_for(lambda: probe(port, "/readyz") == (200, "ready\n"), 30, "the relay to be ready")
        assert probe(port, "/healthz") == (200, "alive\n")
        assert "outbox_relay_shards_owned" in probe(port, "/metrics")[1]

        # One shard, two relays: the second one's fair share is 0, and a standby is ready.
        standby = start(["relay", "--metrics-port", str(standby_port), "--worker-id", "b"], env,
                        tmp_path / "b.log")
        wait_until_bound(standby.pid, standby_port, "the standby's health server",
                         alive=lambda: standby is not None and standby.poll() is None)
        wait_for(lambda: probe(standby_port, "/readyz") == (200, "ready\n"), 30, "the standby to be ready")

        own_postgres.stop()
        _, body = wait_for(lambda: (r := probe(port, "/readyz"))[0] == 503 and r, 30,
                                "/readyz to report the database")
        assert body.startswith("not ready: database"), body
        assert probe(port, "/healthz") == (200, "alive\n")  # an outage never asks for a restart

        own_postgres.start()
        wait_for(lambda: probe(port, "/readyz") == (200, "ready\n"), 30, "the relay to be ready again")
        assert relay.poll() is None and standby.poll() is None
    finally:
        for process in (relay, standby):
            if process is not None:
                stop(process)
    assert relay.returncode == 0, (tmp_path / "a.log").read_text()


# A group per test (also the Kafka group): librdkafka's mock cluster keeps a closed consumer in
# its group until its session times out (45 s), and a new member of that group waits so long.
INBOX_APP = """
from outbox import Inbox, create_engine

inbox = Inbox(create_engine({db!r}), group="health-{topic}")


@inbox.handler({topic!r})
def handle(session, message):
    pass
"""

ASYNC_INBOX_APP = """
from outbox import Inbox, create_async_engine

inbox = Inbox(create_async_engine({db!r}), group="health-{topic}")


@inbox.handler({topic!r})
async def handle(session, message):
    pass
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", INBOX_KINDS)  # async: its readiness ping runs on the inbox's loop
def test_a_consumer_is_ready_once_it_holds_a_partition(
    postgres_db: str, any_kafka: str, topic: str, tmp_path: Path, kind: str
) -> None:
    Outbox(create_engine(postgres_db)).create_tables()
    from confluent_kafka import Producer

    creates_the_topic = Producer({"bootstrap.servers": any_kafka})
    creates_the_topic.produce(topic, b"{}")  # an unknown record parks; readiness is what is tested
    assert creates_the_topic.flush(10) == 0
    app, db = (INBOX_APP, postgres_db) if kind == "sync" else (ASYNC_INBOX_APP, async_url(postgres_db))
    (tmp_path / "healthapp.py").write_text(app.format(db=db, topic=topic))
    port = free_port()
    consumer = start(["inbox", "run", "healthapp:inbox", "--metrics-port", str(port),
                      "-X", "fetch.wait.max.ms=10"], {"OUTBOX_BOOTSTRAP_SERVERS": any_kafka},
                     tmp_path / "inbox.log", cwd=tmp_path)
    try:
        wait_until_bound(consumer.pid, port, "the consumer's health server",
                         alive=lambda: consumer.poll() is None)
        wait_for(lambda: probe(port, "/healthz")[0] == 200, 30, "the consumer's port")
        wait_for(lambda: probe(port, "/readyz") == (200, "ready\n"), 60, "a partition to be assigned")
        assert "outbox_inbox" in probe(port, "/metrics")[1]
    finally:
        stop(consumer)
    assert consumer.returncode == 0, (tmp_path / "inbox.log").read_text()


def every_option() -> list[tuple[str, TyperOption]]:
    found = []

    def walk(command: object, path: str) -> None:
        if isinstance(command, TyperGroup):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}".strip())
        else:
            found.extend((path, p) for p in command.params  # type: ignore[attr-defined]
                         if isinstance(p, TyperOption))
    walk(typer.main.get_command(app), "")
    return found


@pytest.mark.parametrize("path, option", every_option(), ids=lambda v: getattr(v, "name", v))
def test_every_option_reads_an_outbox_variable_unless_it_picks_what_an_action_hits(
    path: str, option: TyperOption
) -> None:
    long_name = next(o for o in option.opts if o.startswith("--")).lstrip("-")
    if long_name in COMMAND_LINE_ONLY:
        assert option.envvar is None, f"{path} --{long_name} must be read from the command line only"
        return
    names = [option.envvar] if isinstance(option.envvar, str) else list(option.envvar or [])
    assert names and names[0].startswith("OUTBOX_"), f"{path} --{long_name} has no OUTBOX_ variable"
    assert option.show_envvar, f"{path} --{long_name} hides its variable from --help"
