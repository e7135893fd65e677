"""A production relay: PostgreSQL outbox -> Kafka over SASL_SSL, metrics on :9464.

Settings use kafka-python-ng names (raw librdkafka keys work too); secrets come
from the environment and never appear in logs or reprs. Run one per host or
pod; several relays share the outbox's shards through leases.

    OUTBOX_DB=postgresql+psycopg://app@db/app OUTBOX_BOOTSTRAP_SERVERS=broker-1:9093 \\
    OUTBOX_KAFKA_USERNAME=relay OUTBOX_KAFKA_PASSWORD=... python examples/relay_postgres_kafka.py
"""

from __future__ import annotations

import logging
import os
import socket

from outbox import Outbox, Relay, WebhookAlertSink, create_engine
from transports.kafka import KafkaTransport


def kafka_settings(bootstrap: str, username: str | None, password: str | None) -> dict:
    settings = {
        "bootstrap_servers": bootstrap,
        "client_id": f"outbox-relay-{socket.gethostname()}",
        "linger_ms": 5,
        "compression_type": "zstd",
    }
    if username:
        settings |= {
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": username,
            "sasl_plain_password": password,
            "ssl_cafile": os.environ.get("OUTBOX_KAFKA_CA_FILE", "/etc/ssl/certs/ca-certificates.crt"),
        }
    return settings


def build_relay(db_url: str, bootstrap: str, *, username: str | None = None,
                password: str | None = None, alert_webhook: str | None = None) -> Relay:
    outbox = Outbox(create_engine(db_url, pool_size=4))
    transport = KafkaTransport(kafka_settings(bootstrap, username, password))
    alert = WebhookAlertSink(alert_webhook) if alert_webhook else None
    return Relay(outbox, transport, batch_size=1000, lease_ttl=10, alert=alert)


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    relay = build_relay(
        os.environ["OUTBOX_DB"], os.environ["OUTBOX_BOOTSTRAP_SERVERS"],
        username=os.environ.get("OUTBOX_KAFKA_USERNAME"), password=os.environ.get("OUTBOX_KAFKA_PASSWORD"),
        alert_webhook=os.environ.get("OUTBOX_ALERT_WEBHOOK"),
    )
    from prometheus_client import start_http_server

    start_http_server(int(os.environ.get("OUTBOX_METRICS_PORT", "9464")))
    relay.run()  # until SIGTERM: drains in-flight sends, releases its leases, returns


if __name__ == "__main__":
    main()
