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
from transports.kafka import KafkaSource, KafkaTransport, librdkafka_config, property_of

LEGACY_TOPIC_ALIAS = ("enable.auto.commit", "auto.commit.enable")
"""The one alias that is not the property the client reads: the topic-level ``auto.commit.enable``
of librdkafka's legacy simple consumer. The high-level consumer reads the global
``enable.auto.commit``, a property of its own."""


def installed_table() -> str:
    """The property table (CONFIGURATION.md) of the librdkafka confluent-kafka loaded."""
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
        return table.read()


def installed_aliases() -> set[tuple[str, str]]:
    """Every (alias, property) of the librdkafka confluent-kafka loaded, from its own table."""
    text = installed_table()
    return {(m[1], m[2]) for m in re.finditer(r"^(\S+)\s+\|.*?Alias for `([^`]+)`", text, re.M)}


def installed_names() -> tuple[set[str], set[str]]:
    """The (global, topic-level) property names of the librdkafka confluent-kafka loaded."""
    everything, topic = installed_table().split("## Topic configuration properties")
    def names(text: str) -> set[str]:
        return {m[1] for m in re.finditer(r"^([a-z][\w.]*)\s+\|", text, re.M)}
    return names(everything), names(topic)


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


def test_a_topic_level_property_under_its_topic_prefix_is_that_property() -> None:
    """librdkafka takes a topic-level property as ``topic.<name>`` too (``rd_kafka_topic_conf_set``
    drops the prefix): ``topic.message.timeout.ms`` is the message timeout. Unless the bare name is
    also a global property of another meaning (``topic.enable.auto.commit`` is the legacy consumer's),
    and the global ``topic.*`` properties are their own."""
    global_names, topic_names = installed_names()
    assert {"message.timeout.ms", "acks", "auto.offset.reset"} <= topic_names  # the table was read
    same = {name for name in topic_names if name not in global_names or name.startswith("compression.")}
    assert [n for n in sorted(same) if property_of(f"topic.{n}") != property_of(n)] == []
    assert [n for n in sorted(topic_names - same) if property_of(f"topic.{n}") != f"topic.{n}"] == []
    assert [n for n in sorted(global_names) if n.startswith("topic.") and property_of(n) != n] == []


@pytest.mark.parametrize("timeout", [
    {"topic.message.timeout.ms": 5000}, {"topic.delivery.timeout.ms": 5000},
    {"default.topic.config": {"message.timeout.ms": 5000}},
    {"default.topic.config": {"topic.delivery.timeout.ms": 5000}},
])
def test_a_message_timeout_under_any_name_is_the_users_and_turns_the_transport_to_waves(
        timeout: dict) -> None:
    """A user's timeout sat beside the transport's ``message.timeout.ms=0``: under ``topic.`` it lost
    by dict order, in ``default.topic.config`` (applied last by confluent-kafka) it won while the
    transport, seeing no timeout, pipelined a key's records, and librdkafka could then drop one and
    write its successor."""
    transport = KafkaTransport(timeout, bootstrap_servers="127.0.0.1:9")
    assert not transport._pipelined and transport._config["message.timeout.ms"] == 5000
    assert set(transport._config) & {"topic.message.timeout.ms", "default.topic.config"} == set()
    transport.close()


def test_default_topic_config_is_read_as_settings_of_its_mapping() -> None:
    """Its settings are properties like the others': two names of one are refused, a secret in it is
    redacted (the transport's repr showed it), and a value that is no mapping is a clear refusal."""
    nested = {"default.topic.config": {"acks": 1, "linger.ms": 7}}
    assert librdkafka_config(nested) == {"acks": 1, "linger.ms": 7}
    with pytest.raises(ConfigurationError, match=r"'message\.timeout\.ms' and 'delivery\.timeout\.ms' \(in "
                                                 r"'default\.topic\.config'\) both set"):
        librdkafka_config({"message.timeout.ms": 1, "default.topic.config": {"delivery.timeout.ms": 2}})
    with pytest.raises(ConfigurationError, match=r"'default\.topic\.config' must be a mapping"):
        librdkafka_config({"default.topic.config": "acks=all"})
    transport = KafkaTransport({"default.topic.config": {"sasl.password": "hunter2-secret"}},
                               bootstrap_servers="127.0.0.1:9")
    assert "hunter2-secret" not in repr(transport)
    transport.close()


def test_the_sources_defaults_are_written_under_the_users_name_for_them() -> None:
    """``auto.offset.reset=earliest`` is the source's default; a user's ``topic.auto.offset.reset``
    sat beside it, and what the source reads (its starvation watch) was not what librdkafka used."""
    source = KafkaSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                         settings={"topic.auto.offset.reset": "latest"})
    assert source.config["auto.offset.reset"] == "latest" and "topic.auto.offset.reset" not in source.config
    source.close()


@pytest.mark.parametrize(("given", "named"), [
    ({"linger_ms": -1}, r"'queue\.buffering\.max\.ms' is librdkafka's name of 'linger\.ms'"),
    ({"retries": -5}, r"'message\.send\.max\.retries' is librdkafka's name of 'retries'"),
    ({"compression.type": "foo"}, r"'compression\.codec' is librdkafka's name of 'compression\.type'"),
])
def test_a_value_librdkafka_refuses_is_named_by_the_setting_given_too(given: dict, named: str) -> None:
    """librdkafka names a property by its own name: ``linger_ms=-1`` came back as a range error of
    ``queue.buffering.max.ms``, a setting nobody gave."""
    with pytest.raises(ConfigurationError, match=named):
        KafkaTransport(bootstrap_servers="127.0.0.1:9", **given)


@pytest.mark.parametrize("settings", [{5: 1}, {b"linger.ms": 1}, {"default.topic.config": {None: 1}}])
def test_a_name_that_is_no_str_is_refused_as_such(settings: dict) -> None:
    """It ended in Python's ``TypeError: argument of type 'int' is not iterable``."""
    with pytest.raises(ConfigurationError, match="name must be a str, got a"):
        librdkafka_config(settings)
