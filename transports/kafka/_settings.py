"""Client settings: kafka-python-ng style names or raw librdkafka keys, checked up front.

Teams moving from kafka-python keep their keyword arguments
(``bootstrap_servers``, ``linger_ms``, ``sasl_plain_password`` …); raw librdkafka
keys (``"linger.ms"``) pass through. An unknown name raises
``ConfigurationError`` when the client is built. Secrets are never shown.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from transports._errors import ConfigurationError

# kafka-python-ng keyword -> librdkafka property
KAFKA_PYTHON_NAMES: dict[str, str] = {
    "bootstrap_servers": "bootstrap.servers",
    "client_id": "client.id",
    "acks": "acks",
    "linger_ms": "linger.ms",
    "batch_size": "batch.size",
    "compression_type": "compression.type",
    "retries": "retries",
    "retry_backoff_ms": "retry.backoff.ms",
    "request_timeout_ms": "request.timeout.ms",
    "delivery_timeout_ms": "message.timeout.ms",
    "max_request_size": "message.max.bytes",
    "max_in_flight_requests_per_connection": "max.in.flight.requests.per.connection",
    "enable_idempotence": "enable.idempotence",
    "metadata_max_age_ms": "topic.metadata.refresh.interval.ms",
    "reconnect_backoff_ms": "reconnect.backoff.ms",
    "reconnect_backoff_max_ms": "reconnect.backoff.max.ms",
    "connections_max_idle_ms": "connections.max.idle.ms",
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "sasl_kerberos_service_name": "sasl.kerberos.service.name",
    "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location",
    "ssl_password": "ssl.key.password",
    "ssl_crlfile": "ssl.crl.location",
    "ssl_ciphers": "ssl.cipher.suites",
    "ssl_check_hostname": "ssl.endpoint.identification.algorithm",
    # consumer side
    "group_id": "group.id",
    "group_instance_id": "group.instance.id",
    "auto_offset_reset": "auto.offset.reset",
    "enable_auto_commit": "enable.auto.commit",
    "session_timeout_ms": "session.timeout.ms",
    "heartbeat_interval_ms": "heartbeat.interval.ms",
    "max_poll_interval_ms": "max.poll.interval.ms",
    "fetch_min_bytes": "fetch.min.bytes",
    "fetch_max_wait_ms": "fetch.wait.max.ms",
    "fetch_max_bytes": "fetch.max.bytes",
    "max_partition_fetch_bytes": "max.partition.fetch.bytes",
    "isolation_level": "isolation.level",
    "partition_assignment_strategy": "partition.assignment.strategy",
}

SECRET_KEYS = frozenset({"sasl.password", "ssl.key.password", "sasl.oauthbearer.client.secret",
                         "ssl.keystore.password", "ssl.key.pem", "sasl.oauthbearer.config"})
"""Settings whose values never appear in a repr, a log line or an error (librdkafka's own
debug output, ``debug=conf``, redacts them too). The SASL user name is shown: it says who
connects, and is no credential alone."""


def _value(name: str, value: Any) -> Any:
    if name == "ssl.endpoint.identification.algorithm" and isinstance(value, bool):
        return "https" if value else "none"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return value


ALIASES: dict[str, str] = {
    "metadata.broker.list": "bootstrap.servers",
    "queue.buffering.max.ms": "linger.ms",
    "message.send.max.retries": "retries",
    "delivery.timeout.ms": "message.timeout.ms",
    "request.required.acks": "acks",
    "compression.codec": "compression.type",
    "max.in.flight": "max.in.flight.requests.per.connection",
    "fetch.message.max.bytes": "max.partition.fetch.bytes",
    "sasl.mechanisms": "sasl.mechanism",
    "sasl.oauthbearer.client.credentials.client.id": "sasl.oauthbearer.client.id",
    "sasl.oauthbearer.client.credentials.client.secret": "sasl.oauthbearer.client.secret",
}
"""librdkafka's properties that have two names (``_RK_C_ALIAS`` in its ``rdkafka_conf.c``): the
other name -> the one this package writes and reads. Every name is the property, so a config
holds one spelling of each and a check of ``"linger.ms"`` sees ``queue.buffering.max.ms`` too.
Not here: the topic-level ``auto.commit.enable`` (alias ``enable.auto.commit`` at topic scope),
which the high-level consumer does not read; its global ``enable.auto.commit`` is another
property. ``tests/test_kafka_settings.py`` checks each pair against the librdkafka installed."""


TOPIC_PREFIX = "topic."

TOPIC_PROPERTIES = frozenset({
    "request.required.acks", "acks", "request.timeout.ms", "message.timeout.ms", "delivery.timeout.ms",
    "queuing.strategy", "produce.offset.report", "partitioner", "partitioner_cb", "msg_order_cmp",
    "compression.codec", "compression.type", "compression.level", "auto.commit.enable",
    "auto.offset.reset", "offset.store.path", "offset.store.sync.interval.ms",
    "consume.callback.max.messages",
})
"""librdkafka's topic-level properties that a client's config also takes as ``topic.<name>``
(``rd_kafka_topic_conf_set`` drops the prefix): ``topic.message.timeout.ms`` is
``message.timeout.ms``. Not here: the topic-level names that are also global properties of
another meaning (``enable.auto.commit``, ``auto.commit.interval.ms``, ``offset.store.method``,
``opaque``: with the prefix they are the legacy consumer's, not the global one). The topic-level
``compression.*`` is here: it overrides the global one, so the two are one setting.
``tests/test_kafka_settings.py`` checks the set against the librdkafka installed."""

NESTED = "default.topic.config"
"""confluent-kafka's mapping of settings inside the config (a deprecated way to give topic-level
ones; it takes any). Each of its settings is applied after the others, whatever the dict order:
its entries are read as settings of the mapping that holds it."""


def property_of(key: str) -> str:
    """The librdkafka property a setting's name sets, in this package's spelling of it.

    A kafka-python-ng keyword stands for its property (``linger_ms``: ``linger.ms``), and so
    does either name of an aliased one (``queue.buffering.max.ms``: ``linger.ms``) and a
    topic-level property's ``topic.`` name (``topic.delivery.timeout.ms``: ``message.timeout.ms``).
    """
    name = KAFKA_PYTHON_NAMES.get(key, key)
    if name.startswith(TOPIC_PREFIX) and name[len(TOPIC_PREFIX):] in TOPIC_PROPERTIES:
        name = name[len(TOPIC_PREFIX):]
    return ALIASES.get(name, name)


def _entries(given: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """(name as shown in an error, name, value) of each setting of ``given``, those of its
    ``default.topic.config`` included (``NESTED``)."""
    entries = []
    for key, value in given.items():
        if key != NESTED:
            entries.append((repr(key), key, value))
        elif not isinstance(value, Mapping):
            raise ConfigurationError(f"Kafka setting {NESTED!r} must be a mapping of settings, "
                                     f"got a {type(value).__name__}: give its settings as the others")
        else:
            entries.extend((f"{inner!r} (in {NESTED!r})", inner, v) for inner, v in value.items())
    for _, key, _ in entries:
        if not isinstance(key, str):
            raise ConfigurationError(f"a Kafka setting's name must be a str, got a {type(key).__name__}")
    return entries


def librdkafka_config(
    settings: Mapping[str, Any] | None = None, /, **kwargs: Any
) -> dict[str, Any]:
    """Translate kafka-python-ng keywords and raw keys into one librdkafka dict, one key per property.

    Both ``settings`` and ``kwargs`` may hold kafka-python-ng names or raw
    librdkafka keys; anything else raises ``ConfigurationError`` naming it.
    Each property is keyed by ``property_of`` its name, so what reads the config
    finds a setting whatever its spelling, and a default or override written
    under one name cannot lose to the user's other name for it. A keyword
    overrides the same property in ``settings``; two names of one property in
    one of them is an error (which would win is librdkafka's order of setting).
    A ``default.topic.config`` mapping's settings count as its holder's (``NESTED``).
    """
    config: dict[str, Any] = {}
    for given in (settings or {}), kwargs:
        named: dict[str, str] = {}
        for shown, key, value in _entries(given):
            if key not in KAFKA_PYTHON_NAMES and "." not in key and key not in _SINGLE_WORD_KEYS:
                raise ConfigurationError(
                    f"unknown Kafka setting {shown}: use a kafka-python-ng name "
                    f"(e.g. bootstrap_servers, linger_ms) or a librdkafka key (e.g. 'linger.ms')"
                )
            prop = property_of(key)
            if prop in named:
                raise ConfigurationError(f"Kafka settings {named[prop]} and {shown} both set "
                                         f"librdkafka's {prop!r}: give one")
            named[prop] = shown
            config[prop] = _value(prop, value)
    return config


_SINGLE_WORD_KEYS = frozenset({"acks", "retries", "debug", "partitioner", "log_level"})


def sets_property(settings: Mapping[str, Any], name: str) -> bool:
    """Whether ``settings`` set the librdkafka property ``name``, under any of its names.

    A kafka-python-ng keyword counts as the property it stands for (``linger_ms``
    sets ``linger.ms``), and so does librdkafka's alias (``queue.buffering.max.ms``):
    what is compared is the property, not its spelling.
    """
    wanted = property_of(name)
    return any(property_of(key) == wanted for _, key, _ in _entries(settings))


def check_with_librdkafka(config: Mapping[str, Any], client: str = "producer") -> None:
    """Let librdkafka reject unknown or invalid keys now, as a ConfigurationError."""
    from confluent_kafka import Consumer, KafkaException, Producer

    probe = dict(config)
    probe.setdefault("bootstrap.servers", "127.0.0.1:9")
    probe["log_level"] = 0  # the probe never connects; keep it quiet
    if client == "consumer":
        probe.setdefault("group.id", "config-check")
    try:
        instance = (Consumer if client == "consumer" else Producer)(probe)
    except KafkaException as exc:
        raise ConfigurationError(f"invalid Kafka setting: {_explained(exc.args[0].str(), config)}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"invalid Kafka setting: {_explained(str(exc), config)}") from None
    if client == "consumer":
        instance.close()


def is_secret(key: str) -> bool:
    """Whether the setting ``key`` (a librdkafka name) holds a credential.

    Besides the known names, any password, passphrase or secret, and any private key
    given inline (``….key.pem``): librdkafka adds such settings release by release
    (2.10's ``sasl.oauthbearer.assertion.private.key.pem`` and its ``….passphrase``).
    """
    return (key in SECRET_KEYS or "password" in key or "passphrase" in key or "secret" in key
            or key.endswith("key.pem"))


def redacted(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with secret values replaced, for logs and reprs."""
    return {k: ("***" if is_secret(k) else v) for k, v in config.items()}


def _explained(message: str, config: Mapping[str, Any]) -> str:
    """librdkafka's refusal, scrubbed, on one line, and saying which setting a property it names by
    its other name is: it says ``queue.buffering.max.ms`` of a ``linger_ms`` or ``linger.ms``."""
    message = " ".join(_scrub(message, config).split())
    for name in dict.fromkeys(re.findall(r'"([^"\s]+)"', message)):
        prop = property_of(name)
        if prop != name and prop in config:
            message += f" ({name!r} is librdkafka's name of {prop!r})"
    return message


def _scrub(message: str, config: Mapping[str, Any]) -> str:
    """``message`` with every secret setting's value masked (librdkafka quotes a value it refuses)."""
    for key, value in config.items():
        if is_secret(key) and len(str(value)) >= 4:  # a shorter one would mask ordinary words
            message = message.replace(str(value), "***")
    return message
