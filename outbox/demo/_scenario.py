"""The demo's script: start the broker and both services, break things, check everything."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import OutboxTables
from ..core._terminal import stdout_console
from ._orders import EVENTS, TOPIC, OrdersService
from ._summary import Summary, read_back
from .billing import build_inbox, faults, invoices

DEADLINE_SECONDS = 90


class Processes:
    """The relay and the billing consumer as real OS processes, logs in the work dir."""

    def __init__(self, workdir: Path, bootstrap: str, orders_url: str, billing_url: str) -> None:
        self.workdir, self.bootstrap = workdir, bootstrap
        self.orders_url, self.billing_url = orders_url, billing_url
        self.relay: subprocess.Popen[bytes] | None = None
        self.consumer: subprocess.Popen[bytes] | None = None
        self.relay_starts = 0

    def _spawn(self, name: str, args: list[str],
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        return subprocess.Popen([sys.executable, "-m", "outbox", *args], stdout=log, stderr=log,
                                env={**os.environ, **(env or {})})

    def start_relay(self) -> None:
        self.relay_starts += 1
        self.relay = self._spawn("relay", [
            "relay", "--db", self.orders_url, "--bootstrap-servers", self.bootstrap,
            "--worker-id", f"demo-relay-{self.relay_starts}", "--lease-ttl", "3",
            "--poll-interval", "0.05",
        ])

    def kill_relay(self) -> None:
        assert self.relay is not None
        self.relay.send_signal(signal.SIGKILL)
        self.relay.wait()

    def start_consumer(self) -> None:
        self.consumer = self._spawn("billing", [
            "inbox", "run", "outbox.demo.billing:inbox", "--bootstrap-servers", self.bootstrap,
            "--kafka-config", "fetch.wait.max.ms=10",
        ], env={"OUTBOX_DEMO_BILLING_DB": self.billing_url,
                "OUTBOX_DEMO_ALERTS": str(self.workdir / "alerts.jsonl")})

    def stop(self) -> list[str]:
        """SIGTERM both; each must drain and exit 0."""
        problems = []
        for name, proc in (("billing consumer", self.consumer), ("relay", self.relay)):
            if proc is None or proc.poll() is not None:
                problems.append(f"{name} exited early with {proc.returncode if proc else None}")
                continue
            proc.send_signal(signal.SIGTERM)
            code: int | str
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "timeout"
            if code != 0:
                problems.append(f"{name} exited with {code} on SIGTERM")
        return problems


def _count(engine: sa.Engine, table: sa.Table, *where: sa.ColumnElement[bool]) -> int:
    with engine.connect() as conn:
        return conn.scalar(sa.select(sa.func.count()).select_from(table).where(*where)) or 0


def run_demo(orders: int = 300, workdir: Path = Path("demo-output"), threads: int = 4,
             console: Console | None = None) -> int:
    """Run the whole demo; return 0 when every check passed, 1 otherwise."""
    from transports.kafka import embedded_kafka

    console = console or stdout_console()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    orders_url = f"sqlite:///{workdir / 'orders.db'}"
    billing_url = f"sqlite:///{workdir / 'billing.db'}"
    poisoned = orders // 2 + 1
    total = orders * len(EVENTS)
    summary = Summary(orders=orders)
    tables = OutboxTables()
    started = time.monotonic()

    with embedded_kafka() as bootstrap:
        console.print(f"[bold]embedded Kafka-protocol broker[/] at {bootstrap}")
        service = OrdersService(orders_url)
        billing = build_inbox(billing_url, workdir / "alerts.jsonl")
        billing_engine = sa.create_engine(billing_url)
        with billing_engine.begin() as conn:
            conn.execute(faults.insert().values(order_id=poisoned))
        console.print(f"orders → [cyan]{escape(orders_url)}[/], billing → [cyan]{escape(billing_url)}[/]; "
                      f"order {poisoned} will be declined by the card processor")

        _create_topic(bootstrap, TOPIC)
        procs = Processes(workdir, bootstrap, orders_url, billing_url)
        procs.start_relay()
        procs.start_consumer()
        with console.status("billing joins its consumer group …"):
            if not _wait_for_line(workdir / "billing.log", "assigned [(", timeout=30):
                console.print("[red]billing never got its partitions[/]; see "
                              f"{escape(str(workdir / 'billing.log'))}")
                procs.stop()
                return 1
        written = [0]
        placing = threading.Thread(target=service.place_all, args=(list(range(1, orders + 1)),),
                                   kwargs={"threads": threads, "events_per_second": 100,
                                           "on_event": lambda: written.__setitem__(0, written[0] + 1)})
        placing.start()

        i = tables.inbox_messages
        with Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            bar_written = progress.add_task("events written (4 threads)", total=total)
            bar_published = progress.add_task("published by the relay", total=total)
            bar_applied = progress.add_task("applied by billing", total=total)
            while time.monotonic() - started < DEADLINE_SECONDS:
                published = service.counts().get("published", 0)
                applied = _count(billing_engine, i)
                progress.update(bar_written, completed=written[0])
                progress.update(bar_published, completed=published)
                progress.update(bar_applied, completed=applied)
                if procs.relay_starts == 1 and published >= total // 3:
                    procs.kill_relay()
                    summary.relay_kills += 1
                    progress.console.print(
                        f"[red]SIGKILL relay[/] after {published} published; restarting it")
                    procs.start_relay()
                parked = _count(billing_engine, tables.inbox_parked)
                if not placing.is_alive() and applied + parked >= total and parked >= 2:
                    break
                time.sleep(0.2)
        placing.join()

        alerts = _read_alerts(workdir / "alerts.jsonl")
        summary.alerts = len(alerts)
        for alert in alerts:
            console.print("[bold red]ALERT[/] " + escape(f"{alert['kind']}: topic={alert['topic']} "
                          f"key={alert['key']} message={alert['message_id']}: {alert['error']}"))
        summary.parked_messages = _count(billing_engine, tables.inbox_parked)
        console.print(f"order {poisoned}: {summary.parked_messages} messages parked; "
                      "fixing the card processor and replaying the key")
        with billing_engine.begin() as conn:
            conn.execute(faults.delete())
        billing.replay(TOPIC, str(poisoned))
        done = _count(billing_engine, invoices, invoices.c.order_id == poisoned,
                      invoices.c.state == "shipped")
        summary.replayed_orders = done
        problems = procs.stop()
        billing_engine.dispose()

    read_back(summary, orders_url, billing_url)
    summary.spark_verdict = _spark_audit(orders_url, billing_url, workdir, console)
    summary.check(expected_events=total)
    summary.failures += problems
    console.print(summary.table())
    elapsed = time.monotonic() - started
    if summary.failures:
        for failure in summary.failures:
            console.print(f"[bold red]FAILED[/] {escape(failure)}")
        console.print(f"logs: {workdir}/relay.log, {workdir}/billing.log", markup=False)
        return 1
    console.print(f"[bold green]all checks passed[/] in {elapsed:.1f} s "
                  f"(zero lost, zero order violations, poisoned order parked then replayed)")
    return 0


def _create_topic(bootstrap: str, topic: str) -> None:
    """Create the topic up front (a metadata request auto-creates it), as a deployment would,
    so the consumer's subscription finds it at once instead of at the next metadata refresh."""
    from confluent_kafka import Producer

    Producer({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)


def _wait_for_line(path: Path, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.1)
    return False


def _read_alerts(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _spark_audit(orders_url: str, billing_url: str, workdir: Path, console: Console) -> str | None:
    """The Spark audit's verdict when the ``spark`` extra and a JVM are present."""
    try:
        from ..spark import audit, spark_session
    except ImportError:
        return None
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return None
    console.print("running the Spark audit (outbox vs inbox, two databases) …")
    # A few hundred rows: a handful of shuffle partitions; only errors from the JVM in the demo's output.
    spark = spark_session(app_name="outbox-demo", config={
        "spark.sql.shuffle.partitions": "4", "spark.ui.enabled": "false"}, log_level="ERROR")
    # SLA of one second: after the demo everything must be consumed, so a message
    # published over a second ago and never processed really is lost.
    result = audit(orders_url, billing_url, group="billing", sla="1s", out_dir=workdir / "audit",
                   spark=spark, partitions=2)
    from ..spark._report import verdict  # the report's own first sentence: one verdict, not two

    return f"{verdict(result.summary)}; duplicated {result.totals['duplicated_messages']}; " \
           f"chart {result.path('chart.png')}"
