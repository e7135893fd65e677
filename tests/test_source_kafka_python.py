"""``KafkaPythonSource``: the same inbox contract on kafka-python-ng instead of librdkafka."""

from __future__ import annotations

import threading

import pytest

from outbox import ConfigurationError, Inbox
from tests.inbox_support import AlertLog, applied, apply_effect, business, record
from tests.test_inbox_kafka import committed, produce, wait_for
from transports import Source
from transports.kafka_python import KafkaPythonSource

FAST = {"fetch_max_wait_ms": 10, "session_timeout_ms": 6000, "heartbeat_interval_ms": 500}


def test_settings_are_checked_when_the_source_is_built() -> None:
    with pytest.raises(ConfigurationError, match="enable_auto_commit must stay off"):
        KafkaPythonSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"],
                          enable_auto_commit=True)
    with pytest.raises(ConfigurationError, match="invalid kafka-python-ng setting"):
        KafkaPythonSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=["t"], lingerr=1)
    with pytest.raises(ConfigurationError, match="topics"):
        KafkaPythonSource(bootstrap_servers="127.0.0.1:9", group_id="g", topics=[])


def test_the_inbox_runs_on_kafka_python(sqlite_db: str, kafka: str, topic: str) -> None:
    from outbox import create_engine

    engine = create_engine(sqlite_db)
    inbox = Inbox(engine, group=f"g-{topic}", alert=AlertLog(), batch_size=8)
    inbox.create_tables()
    business.create_all(engine)
    inbox.handler(topic)(apply_effect)
    records = [record(topic, f"k{k}", seq) for seq in (1, 2, 3) for k in range(10)]
    produce(kafka, records)
    produce(kafka, records)  # duplicates on the wire
    source = KafkaPythonSource(bootstrap_servers=kafka.split(","), group_id=inbox.group,
                               topics=[topic], **FAST)
    assert isinstance(source, Source)
    thread = threading.Thread(target=inbox.run, args=(source,),
                              kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        wait_for(lambda: sum(committed(kafka, inbox.group, topic).values()) == 60,
                 what="all 60 records committed")
    finally:
        inbox.stop()
        thread.join(30)
    assert not thread.is_alive()
    for k in range(10):
        assert [s for _, s in applied(engine, f"k{k}")] == [1, 2, 3]
    assert len(applied(engine)) == 30
