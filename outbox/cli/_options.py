"""Options shared by several commands, so each is spelled and parsed one way."""

from __future__ import annotations

import typer

KAFKA_CONFIG = typer.Option(
    [], "--kafka-config", "-X",
    help="KEY=VALUE Kafka setting: a kafka-python-ng name (linger_ms) or a librdkafka key "
         "(linger.ms). Repeat for several.",
)


def parse_kafka_config(pairs: list[str]) -> dict[str, str]:
    """``["linger.ms=5", …]`` → ``{"linger.ms": "5", …}``; a pair without '=' is a usage error."""
    config = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--kafka-config")
        config[name.strip()] = value
    return config


LOG_LEVEL = typer.Option("INFO", "--log-level", help="Python log level (DEBUG, INFO, WARNING …).")


def configure_logging(level: str) -> None:
    """One log format for every long-running command (relay, inbox)."""
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
