"""Kafka settings are properties, not spellings: librdkafka's two names of one property are one key.

librdkafka gives eleven of its properties a second name (``linger.ms`` for
``queue.buffering.max.ms``, ``bootstrap.servers`` for ``metadata.broker.list`` …).
Code that asks a config for ``"linger.ms"`` must see a linger set under either
name, and a default or override the transport writes must not lose to the
user's other name for it (librdkafka applies a dict's keys in order).
"""

from __future__ import annotations

import ctypes
import re
import tempfile
from pathlib import Path

import confluent_kafka
import pytest

from outbox import ConfigurationError
from transports.kafka import KafkaTransport, librdkafka_config, property_of

LEGACY_TOPIC_ALIAS = ("enable.auto.commit", "auto.commit.enable")
"""The one alias that is not the property the client reads: the topic-level ``auto.commit.enable``
of librdkafka's legacy simple consumer. The high-level consumer reads the global
``enable.auto.commit``, a property of its own."""


def installed_aliases() -> set[tuple[str, str]]:
    """Every (alias, property) of the librdkafka confluent-kafka loaded, from its own table."""
    libs = Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs"
    found = sorted(libs.glob("librdkafka*"))
    assert found, f"no librdkafka under {libs}"
    librdkafka, libc = ctypes.CDLL(str(found[0])), ctypes.CDLL(None)
    libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    librdkafka.rd_kafka_conf_properties_show.argtypes = [ctypes.c_void_p]
    with tempfile.NamedTemporaryFile("r") as table:
        out = libc.fopen(table.name.encode(), b"w")
        librdkafka.rd_kafka_conf_properties_show(out)
        libc.fclose(out)
        text = table.read()
    return {(m[1], m[2]) for m in re.finditer(r"^(\S+)\s+\|.*?Alias for `([^`]+)`", text, re.M)}


def test_each_alias_of_the_installed_librdkafka_is_one_property_with_its_target() -> None:
    aliases = installed_aliases()
    assert ("linger.ms", "queue.buffering.max.ms") in aliases  # the table was read
    assert LEGACY_TOPIC_ALIAS in aliases
    split = [pair for pair in aliases - {LEGACY_TOPIC_ALIAS} if property_of(pair[0]) != property_of(pair[1])]
    assert split == []
    assert property_of(LEGACY_TOPIC_ALIAS[0]) != property_of(LEGACY_TOPIC_ALIAS[1])


@pytest.mark.parametrize(("settings", "key", "value"), [
    ({"queue.buffering.max.ms": 100}, "linger.ms", 100),
    ({"linger_ms": 100}, "linger.ms", 100),
    ({"delivery.timeout.ms": 9000}, "message.timeout.ms", 9000),
    ({"metadata.broker.list": "h:1"}, "bootstrap.servers", "h:1"),
    ({"compression.codec": "zstd"}, "compression.type", "zstd"),
    ({"sasl.mechanisms": "PLAIN"}, "sasl.mechanism", "PLAIN"),
])
def test_a_config_holds_each_property_under_one_name(settings: dict, key: str, value: object) -> None:
    assert librdkafka_config(settings) == {key: value}


def test_two_names_of_one_property_in_one_mapping_are_refused_naming_both() -> None:
    with pytest.raises(ConfigurationError, match=r"'linger\.ms' and 'queue\.buffering\.max\.ms' both set"):
        librdkafka_config({"linger.ms": 5, "queue.buffering.max.ms": 100})
    with pytest.raises(ConfigurationError, match=r"'linger_ms' and 'linger\.ms' both set"):
        librdkafka_config(None, linger_ms=5, **{"linger.ms": 100})


def test_a_keyword_overrides_its_property_in_the_settings_under_any_name() -> None:
    assert librdkafka_config({"queue.buffering.max.ms": 100}, linger_ms=7) == {"linger.ms": 7}


def test_the_transports_defaults_and_overrides_are_written_over_the_users_other_name() -> None:
    """The transport's 5 ms default and its one-record-per-request producer write ``linger.ms``;
    a user's ``queue.buffering.max.ms`` sat beside it, and librdkafka applied whichever came last."""
    transport = KafkaTransport({"queue.buffering.max.ms": 100, "delivery.timeout.ms": 9000},
                               bootstrap_servers="127.0.0.1:9")
    assert transport._config["linger.ms"] == 100 and "queue.buffering.max.ms" not in transport._config
    assert transport._config["message.timeout.ms"] == 9000 and "delivery.timeout.ms" not in transport._config
    transport.close()


def test_brokers_under_librdkafkas_first_name_are_the_transports_bootstrap_servers() -> None:
    """``metadata.broker.list`` is librdkafka's name of ``bootstrap.servers``: refused before as
    missing servers, and left out of the settings the transport's admin clients connect with
    (``connection_settings`` picks ``bootstrap.servers``)."""
    transport = KafkaTransport({"metadata.broker.list": "127.0.0.1:9"})
    assert transport._config["bootstrap.servers"] == "127.0.0.1:9"
    assert "metadata.broker.list" not in transport._config
    transport.close()
