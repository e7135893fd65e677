"""``outbox dev-broker``: a Kafka-protocol broker on this machine, for development.

A newcomer following docs/getting-started.md has a database (SQLite) but no
Kafka; this runs the embedded broker (librdkafka's mock cluster, the one the
demo and the tests use) until Ctrl-C or SIGTERM, and prints the address and
the commands that use it. It keeps records in memory only, and only the last
few MiB of each partition: it is for trying things, never for production.
"""

from __future__ import annotations

import threading

import typer

from ..core._stopping import stop_signals
from . import app


@app.command("dev-broker")
def dev_broker(
    brokers: int = typer.Option(1, min=1, max=9, envvar="OUTBOX_DEV_BROKERS",
                                help="How many mock brokers the cluster has."),
) -> None:
    """Run an in-memory Kafka-protocol broker for development until Ctrl-C/SIGTERM, then exit 0."""
    try:
        from transports.kafka import embedded_kafka
    except ImportError as exc:
        raise typer.BadParameter(f"{exc} (pip install 'transactional-outbox[kafka]')") from None
    stop = threading.Event()
    with stop_signals(stop.set), embedded_kafka(brokers=brokers) as servers:
        print(usage(servers), flush=True)  # plain print: no markup eaten, no wrapping when piped
        stop.wait()
        print("dev-broker stopped; its topics and records are gone", flush=True)


def usage(servers: str) -> str:
    """What the command prints once the broker answers: its address, then how to use it."""
    return "\n".join([
        f"Kafka-protocol broker (in memory, for development) at {servers}",
        "In another terminal:",
        f"  export OUTBOX_BOOTSTRAP_SERVERS={servers}",
        "  outbox relay --db sqlite:///getting-started.db",
        "  outbox inbox run getting_started_billing:inbox",
        "(or pass --bootstrap-servers " + servers + " to each). Ctrl-C stops it.",
    ])
